"""Name and version validation."""

from __future__ import annotations

import json

import pytest

from flashpoint.errors import BadRequest, InvalidName
from flashpoint.ids import ModelKey, new_id, validate_name, validate_version
from flashpoint.spec import FunctionSpec


@pytest.mark.parametrize("name", ["a", "0", "resnet50", "my-fn.v2_x", "a" * 63, "a.b", "a-"])
def test_valid_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", [
    "", "A", "Abc", ".", "..", "../x", "x/..", "a..b", "a/b", "a\\b", "-a", ".a", "_a", "a" * 64,
    "a b", " a", "ä", "a\x00", None, 5, b"abc", ["a"],
])
def test_invalid_names(name):
    with pytest.raises(InvalidName) as ei:
        validate_name(name, "model name")
    assert isinstance(ei.value, BadRequest)
    assert ei.value.details["field"] == "model name"


@pytest.mark.parametrize("name", ["abc\n", "model\n"])
def test_trailing_newline_rejected(name):
    """BUG: ``$`` in _NAME_RE also matches before a trailing newline, so "abc\\n" passes."""
    with pytest.raises(InvalidName):
        validate_name(name)


def test_trailing_newline_version_rejected():
    """BUG: same ``$`` issue in _VERSION_RE."""
    with pytest.raises(InvalidName):
        validate_version("v1\n")


@pytest.mark.parametrize("v", ["1", "V2", "2024.01.01", "a_B-c", "X" * 63])
def test_valid_versions(v):
    assert validate_version(v) == v


@pytest.mark.parametrize("v", ["", "..", "1..2", "../1", "-1", "a/b", "X" * 64, 1, None])
def test_invalid_versions(v):
    with pytest.raises(InvalidName):
        validate_version(v)


def test_new_id():
    a, b = new_id("req"), new_id("req")
    assert a.startswith("req-") and len(a) == 4 + 16
    assert a != b


def test_model_key_is_its_wire_string_and_splits_exactly():
    key = ModelKey.of("bert-small", "v1.2")
    assert key == "bert-small@v1.2" and isinstance(key, str)  # the wire and log form
    assert (key.name, key.version) == ("bert-small", "v1.2")
    assert {key: 1}["bert-small@v1.2"] == 1  # a key read back from a peer finds it
    parsed = ModelKey.parse("bert-small@v1.2")
    assert parsed == key and parsed.version == "v1.2"
    assert ModelKey.parse(key) is key
    assert json.loads(json.dumps({"m": key})) == {"m": "bert-small@v1.2"}


@pytest.mark.parametrize("bad", ["", "bert", "@v1", "bert@", "@"])
def test_model_key_parse_refuses_what_is_not_name_at_version(bad):
    with pytest.raises(InvalidName):
        ModelKey.parse(bad)


def test_a_spec_names_its_model_version_by_model_key():
    spec = FunctionSpec(name="fn", model="m", model_version="3")
    assert spec.model_key == ModelKey.of("m", "3") == "m@3"
    assert isinstance(spec.model_key, ModelKey)
