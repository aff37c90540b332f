"""Model profiles: the thesis's six models keep the stated anchors; a measured manifest
turns into the same profile type."""

from __future__ import annotations

import pytest

from flashpoint.partition.model import LayerProfile
from flashpoint.registry.manifest import IoSignature, LayerInfo, Manifest
from flashpoint.sim.models import MB, THESIS_MODELS, profile_from_manifest, thesis_model


def test_six_models_with_table_3_1_sizes_smallest_first():
    sizes = {name: m.size_bytes // MB for name, m in THESIS_MODELS.items()}
    assert sizes == {"codebert": 499, "albert": 890, "bart": 1626, "dialogpt": 3135,
                     "gpt2": 6282, "t5": 11408}
    assert list(sizes.values()) == sorted(sizes.values())


def test_t5_matches_the_a10_anchors():
    t5 = thesis_model("t5")
    assert len(t5.layers) == 55
    assert t5.load_s == pytest.approx(14.138)
    assert t5.to_device_s == pytest.approx(1.206)
    # Fig 3.6: load is 214 warm inferences, send 18 (≈ 67 ms either way).
    assert t5.load_s / t5.exec_s == pytest.approx(214.0)
    assert t5.to_device_s / t5.exec_s == pytest.approx(18.0, rel=0.1)
    # Download at the measured 2,203 Mbit/s ≈ 41 s, 581 warm inferences (Fig 3.6); the
    # thesis's anchors disagree by ~8% (41.4 s / 66 ms = 627), hence the tolerance.
    assert t5.size_bytes * 8 / 2_203e6 / t5.exec_s == pytest.approx(581.2, rel=0.1)


@pytest.mark.parametrize("name", list(THESIS_MODELS))
def test_layers_tile_the_model(name):
    m = THESIS_MODELS[name]
    assert sum(layer.bytes for layer in m.layers) == m.size_bytes
    assert sum(layer.exec_s for layer in m.layers) == pytest.approx(m.exec_s)
    assert m.stage_bytes(0, len(m.layers) - 1) == m.size_bytes
    assert m.startup_s(m.size_bytes // 2) == pytest.approx(m.startup_s() / 2, rel=1e-6)


def test_unknown_model_is_an_error():
    with pytest.raises(ValueError, match="unknown model"):
        thesis_model("llama")


def _manifest(profiled: bool = True) -> Manifest:
    layers, start = [], 0
    for i, (b, t, o) in enumerate([(1000, 0.001, 64), (3000, 0.004, 32), (2000, 0.002, 16)]):
        prof = {"bytes": b, "exec_time_s": t, "output_bytes": o} if profiled else {}
        layers.append(LayerInfo(f"layers.{i}", (), start, start + b, prof))
        start += b
    return Manifest(name="bert-tiny", version="3", blob_size=start, data_offset=64,
                    chunk_size=4096, chunk_sha256=("0" * 64,), tensors={},
                    layers=tuple(layers), entry_point="pkg:build", config={},
                    io=IoSignature((), ()))


def test_manifest_profile_becomes_a_model_profile():
    p = profile_from_manifest(_manifest(), load_bytes_per_s=1e6, to_device_bytes_per_s=1e7)
    assert p.name == "bert-tiny" and p.size_bytes == 6000
    assert p.layers[1] == LayerProfile("layers.1", 3000, 0.004, 32)
    assert p.exec_s == pytest.approx(0.007)
    assert p.load_s == pytest.approx(0.006) and p.to_device_s == pytest.approx(0.0006)
    assert "measured" in p.source


def test_manifest_without_profile_is_refused():
    with pytest.raises(ValueError, match="no per-layer profile"):
        profile_from_manifest(_manifest(profiled=False))
