"""The blob layout and the manifest: safetensors compatibility, alignment, zero-copy views."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file

from flashpoint.errors import BadRequest, IntegrityError, InvalidName
from flashpoint.registry import (
    ALIGN_BYTES,
    DTYPES,
    PAD_PREFIX,
    ChunkHasher,
    IoSignature,
    Manifest,
    build_blob,
    byte_range_for_layers,
    chunk_ranges,
    from_safetensors,
    from_state_dict,
    make_manifest,
    parse_header,
    tensor_views,
    tensors_for_layers,
    to_state_dict,
    verify_chunk,
)
from flashpoint.spec import TensorSpec

IO = IoSignature(
    inputs=(TensorSpec("x", "FP32", (-1, 3)),), outputs=(TensorSpec("y", "INT64", (-1,)),)
)


def sample_layers():
    g = torch.Generator().manual_seed(7)
    return [
        ("emb", [("emb.w", torch.randn(5, 3, generator=g)),
                 ("emb.ids", torch.arange(3, dtype=torch.int64))]),
        ("empty", []),
        ("mix", [("mix.h", torch.randn(7, generator=g).to(torch.float16)),
                 ("mix.b", torch.randn(3, 1, generator=g).to(torch.bfloat16)),
                 ("mix.mask", torch.tensor([True, False, True])),
                 ("mix.scalar", torch.tensor(2.5)),
                 ("mix.none", torch.zeros(0, 4)),
                 ("mix.u8", torch.arange(11, dtype=torch.uint8)),
                 ("mix.i32", torch.tensor([[1, -2], [3, -4]], dtype=torch.int32))]),
    ]


def flat(layers):
    return [(n, t) for _, ts in layers for n, t in ts]


def sample_manifest(chunk_size: int = 100):
    layers = sample_layers()
    blob, layout = build_blob(layers, chunk_size=chunk_size)
    manifest = make_manifest(
        name="sample", version="1", layout=layout, entry_point="pkg.mod:build",
        config={"k": [1, 2]}, io=IO,
    )
    return layers, blob, manifest


def test_blob_is_valid_safetensors_with_the_same_tensors(tmp_path):
    layers = sample_layers()
    blob, _ = build_blob(layers)
    loaded = st_load(blob)
    for name, t in flat(layers):
        assert torch.equal(loaded[name], t), name
    model_names = {k for k in loaded if not k.startswith(PAD_PREFIX)}
    assert model_names == {n for n, _ in flat(layers)}
    path = tmp_path / "w.safetensors"
    _, layout = build_blob(layers, path=path)
    assert path.read_bytes() == blob
    assert layout.blob_size == len(blob)
    from_file = load_file(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(from_file)
    for name, t in flat(layers):
        assert torch.equal(from_file[name], t)


def test_layout_is_aligned_and_layers_tile_the_data():
    layers, blob, m = sample_manifest()
    assert m.data_offset % ALIGN_BYTES == 0
    (header_len,) = struct.unpack("<Q", blob[:8])
    assert 8 + header_len == m.data_offset
    header_text = blob[8:m.data_offset]
    assert json.loads(header_text)  # space padding keeps it valid JSON
    assert header_text.rstrip(b" ").endswith(b"}")
    for name, info in m.tensors.items():
        assert info.start % ALIGN_BYTES == 0, name
    assert [layer.name for layer in m.layers] == ["emb", "empty", "mix"]
    assert m.layers[0].byte_start == m.data_offset
    for a, b in zip(m.layers, m.layers[1:], strict=False):
        assert a.byte_end == b.byte_start
        assert b.byte_start % ALIGN_BYTES == 0
    assert m.layers[-1].byte_end == m.blob_size
    # Tensors sit inside their layer, in order.
    for layer in m.layers:
        pos = layer.byte_start
        for n in layer.tensors:
            assert layer.byte_start <= m.tensors[n].start and m.tensors[n].end <= layer.byte_end
            assert m.tensors[n].start >= pos
            pos = m.tensors[n].end
    # Padding tensors are only in the safetensors header.
    header, data_offset = parse_header(blob)
    assert data_offset == m.data_offset
    assert any(k.startswith(PAD_PREFIX) for k in header)
    assert not any(k.startswith(PAD_PREFIX) for k in m.tensors)


def test_byte_range_and_tensors_for_layers():
    _, _, m = sample_manifest()
    assert byte_range_for_layers(m, 0, 2) == (m.data_offset, m.blob_size)
    assert byte_range_for_layers(m, "emb", "emb") == (m.layers[0].byte_start, m.layers[0].byte_end)
    assert byte_range_for_layers(m, "empty", "empty")[0] == byte_range_for_layers(m, "empty", "empty")[1]
    assert tensors_for_layers(m, 1, "mix") == list(m.layers[2].tensors)
    with pytest.raises(BadRequest):
        byte_range_for_layers(m, 2, 0)
    with pytest.raises(BadRequest):
        byte_range_for_layers(m, "nope", 1)
    with pytest.raises(BadRequest):
        byte_range_for_layers(m, 0, 3)


def test_chunks_hash_the_whole_blob():
    _, blob, m = sample_manifest(chunk_size=100)
    ranges = chunk_ranges(m.blob_size, m.chunk_size)
    assert len(ranges) == m.num_chunks == -(-len(blob) // 100)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(blob)
    for i, (s, e) in enumerate(ranges):
        assert m.chunk_range(i) == (s, e)
        verify_chunk(m, i, blob[s:e])
    bad = bytearray(blob[0:100])
    bad[5] ^= 1
    with pytest.raises(IntegrityError):
        verify_chunk(m, 0, bad)
    with pytest.raises(IntegrityError):
        verify_chunk(m, 0, blob[0:99])
    with pytest.raises(BadRequest):
        verify_chunk(m, m.num_chunks, b"")
    assert list(m.chunks_for_range(0, 0)) == []
    assert list(m.chunks_for_range(99, 101)) == [0, 1]
    assert list(m.chunks_for_range(100, 200)) == [1]


def test_chunk_hasher_any_piece_sizes():
    data = bytes(range(256)) * 10
    a, b = ChunkHasher(64), ChunkHasher(64)
    a.update(data)
    for i in range(0, len(data), 7):
        b.update(data[i:i + 7])
    assert a.finish() == b.finish()
    assert len(a.digests) == len(data) // 64


def test_tensor_views_are_zero_copy():
    layers, blob, m = sample_manifest()
    buf = bytearray(blob)
    views = tensor_views(m, buf)
    for name, t in flat(layers):
        assert torch.equal(views[name], t)
        assert views[name].dtype == t.dtype and views[name].shape == t.shape
    # Writing the buffer shows through the view: same memory.
    start = m.tensors["emb.ids"].start
    buf[start:start + 8] = struct.pack("<q", 42)
    assert views["emb.ids"][0].item() == 42
    base_ptr = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    assert views["emb.w"].data_ptr() == base_ptr + m.tensors["emb.w"].start


def test_tensor_views_over_a_stage_range_and_read_only_buffer(recwarn):
    layers, blob, m = sample_manifest()
    start, end = byte_range_for_layers(m, "mix", "mix")
    part = bytes(blob[start:end])
    views = tensor_views(m, part, buffer_offset=start, names=tensors_for_layers(m, "mix", "mix"))
    for name, t in layers[2][1]:
        assert torch.equal(views[name], t)
    assert not [w for w in recwarn if "not writable" in str(w.message)]
    with pytest.raises(BadRequest):
        tensor_views(m, part, buffer_offset=start)  # emb tensors are not in the buffer
    with pytest.raises(BadRequest):
        tensor_views(m, part, buffer_offset=start + 1)
    with pytest.raises(BadRequest):
        tensor_views(m, blob, names=["missing"])


def test_manifest_json_round_trip_and_profiles():
    _, _, m = sample_manifest()
    again = Manifest.from_json(m.to_json())
    assert again == m
    assert Manifest.from_json(m.to_json().encode()) == m
    p = m.with_profiles({"emb": {"bytes": 10, "exec_time_s": 0.5, "output_bytes": 12}})
    assert p.layers[0].profile["exec_time_s"] == 0.5
    assert Manifest.from_json(p.to_json()) == p
    with pytest.raises(BadRequest):
        m.with_profiles({"nope": {}})
    with pytest.raises(BadRequest):
        m.with_profiles({"emb": {"bytes": "many"}})


def _mutations():
    def drop(key):
        return lambda d: d.pop(key)

    def setk(key, value):
        return lambda d: d.__setitem__(key, value)

    def tensor(name, key, value):
        return lambda d: d["tensors"][name].__setitem__(key, value)

    def layer(i, key, value):
        return lambda d: d["layers"][i].__setitem__(key, value)

    return {
        "missing key": drop("chunk_sha256"),
        "unknown key": setk("extra", 1),
        "format version": setk("format_version", 2),
        "traversal name": setk("name", "../x"),
        "upper-case name": setk("name", "Bert"),
        "bool size": setk("blob_size", True),
        "float chunk": setk("chunk_size", 100.0),
        "zero chunk": setk("chunk_size", 0),
        "bad hash": lambda d: d["chunk_sha256"].__setitem__(0, "zz"),
        "hash count": lambda d: d["chunk_sha256"].pop(),
        "misaligned offset": setk("data_offset", 65),
        "unknown dtype": tensor("emb.w", "dtype", "C64"),
        "size mismatch": tensor("emb.w", "shape", [5, 4]),
        "misaligned tensor": tensor("emb.w", "start", 1),
        "negative dim": tensor("emb.w", "shape", [-5, -3]),
        "pad tensor": lambda d: d["tensors"].__setitem__(PAD_PREFIX + "0", d["tensors"]["emb.w"]),
        "layer gap": layer(1, "byte_start", 0),
        "unknown layer tensor": layer(0, "tensors", ["emb.w", "nope"]),
        "orphan tensor": layer(0, "tensors", ["emb.w"]),
        "duplicate layer": layer(1, "name", "emb"),
        "layer key": lambda d: d["layers"][0].pop("profile"),
        "bad entry point": setk("entry_point", "os.system"),
        "config list": setk("config", []),
        "io datatype": lambda d: d["io"]["inputs"][0].__setitem__("datatype", "FLOAT"),
        "layers object": setk("layers", {}),
        "not object": lambda d: d.clear(),
    }


@pytest.mark.parametrize("case", sorted(_mutations()))
def test_manifest_from_json_is_strict(case):
    _, _, m = sample_manifest()
    d = json.loads(m.to_json())
    _mutations()[case](d)
    with pytest.raises(BadRequest):
        Manifest.from_json(json.dumps(d))


def test_manifest_from_json_rejects_garbage():
    for text in ["", "{", "[]", "null", b"\xff\xfe", '{"name": 1}']:
        with pytest.raises(BadRequest):
            Manifest.from_json(text)
    _, _, m = sample_manifest()
    d = json.loads(m.to_json())
    d["name"] = "../etc"
    with pytest.raises(InvalidName):
        Manifest.from_json(json.dumps(d))


def test_build_blob_rejects_bad_input():
    t = torch.zeros(2)
    for layers in [
        [("a", [("x", t)]), ("b", [("x", t)])],  # duplicate tensor
        [("a", [("x", t)]), ("a", [("y", t)])],  # duplicate layer
        [("a", [(PAD_PREFIX + "1", t)])],
        [("a", [("__metadata__", t)])],
        [("a", [("x", torch.zeros(2, dtype=torch.complex64))])],
        [("a", [("x", torch.zeros(2, device="meta"))])],
        [("a", [("x", [1, 2])])],
    ]:
        with pytest.raises(BadRequest):
            build_blob(layers)
    with pytest.raises(BadRequest):
        build_blob([("a", [("x", t)])], chunk_size=0)


def test_empty_model_blob():
    blob, layout = build_blob([("only", [])])
    assert st_load(blob) == {}
    m = make_manifest(name="e", version="1", layout=layout, entry_point="a:b", config={}, io=IO)
    assert m.layers[0].byte_start == m.layers[0].byte_end == m.blob_size
    assert tensor_views(m, blob) == {}


def test_state_dict_import_export(tmp_path):
    layers, blob, m = sample_manifest()
    sd = to_state_dict(m, blob)
    assert list(sd) == [n for n, _ in flat(layers)]
    copied = to_state_dict(m, blob, copy=True)
    for n, t in flat(layers):
        assert torch.equal(sd[n], t) and torch.equal(copied[n], t)
    state = {"layers.0.w": torch.ones(2), "layers.1.a.b": torch.zeros(3), "layers.10.w": torch.ones(1)}
    grouped = from_state_dict(state, ["layers.0", "layers.1", "layers.10"])
    assert [(name, [k for k, _ in ts]) for name, ts in grouped] == [
        ("layers.0", ["layers.0.w"]), ("layers.1", ["layers.1.a.b"]), ("layers.10", ["layers.10.w"])
    ]
    with pytest.raises(BadRequest):
        from_state_dict(state, ["layers.0", "layers.1"])


def test_from_safetensors_plain_file_and_own_blob(tmp_path):
    plain = tmp_path / "plain.safetensors"
    tensors = {"b.w": torch.ones(3), "a.w": torch.arange(4, dtype=torch.int32), "a.v": torch.zeros(2, 2)}
    save_file(tensors, str(plain))
    layers = from_safetensors(plain, lambda k: k.split(".")[0], layer_order=["a", "b"])
    assert [name for name, _ in layers] == ["a", "b"]
    got = dict(flat(layers))
    assert set(got) == set(tensors)
    for k, t in tensors.items():
        assert torch.equal(got[k], t)
    with pytest.raises(BadRequest):
        from_safetensors(plain)  # no layer metadata and no layer_of
    own = tmp_path / "own.safetensors"
    original = sample_layers()
    build_blob(original, path=own)
    back = from_safetensors(own)
    assert [(n, [k for k, _ in ts]) for n, ts in back] == [
        (n, [k for k, _ in ts]) for n, ts in original
    ]
    blob_a, _ = build_blob(back)
    blob_b, _ = build_blob(original)
    assert blob_a == blob_b


DTYPE_CODES = sorted(DTYPES)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


@st.composite
def tensor_sets(draw):
    n_layers = draw(st.integers(1, 4))
    layers = []
    k = 0
    for li in range(n_layers):
        tensors = []
        for _ in range(draw(st.integers(0, 4))):
            code = draw(st.sampled_from(DTYPE_CODES))
            shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
            numel = 1
            for s in shape:
                numel *= s
            nbytes = numel * torch.empty(0, dtype=DTYPES[code]).element_size()
            raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
            if code == "BOOL":
                raw = bytes(b & 1 for b in raw)
            if numel:
                u8 = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                t = u8.view(DTYPES[code]).reshape(shape)
            else:
                t = torch.empty(shape, dtype=DTYPES[code])
            tensors.append((f"t{k}", t))
            k += 1
        layers.append((f"layer{li}", tensors))
    return layers, draw(st.integers(1, 300))


@settings(max_examples=60, deadline=None)
@given(tensor_sets())
def test_random_tensor_sets_round_trip_exactly(case):
    layers, chunk_size = case
    blob, layout = build_blob(layers, chunk_size=chunk_size)
    m = make_manifest(name="h", version="1", layout=layout, entry_point="a:b", config={}, io=IO)
    assert Manifest.from_json(m.to_json()) == m
    views = tensor_views(m, blob)
    loaded = st_load(blob)
    for name, t in flat(layers):
        v = views[name]
        assert v.dtype == t.dtype and v.shape == t.shape
        assert m.tensors[name].start % ALIGN_BYTES == 0
        # Compare raw bits (NaN payloads included).
        assert torch.equal(_bits(v), _bits(t))
        assert torch.equal(_bits(loaded[name]), _bits(t))
    for i, (s, e) in enumerate(chunk_ranges(m.blob_size, chunk_size)):
        verify_chunk(m, i, blob[s:e])
