"""Error tree: wire round trips and unknown codes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashpoint import errors
from flashpoint.errors import FlashpointError, RemoteError, from_wire

ALL = errors._all_subclasses(FlashpointError)


def test_codes_unique():
    codes = [c.code for c in ALL]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_round_trip_every_subclass(cls):
    err = cls("something broke", retry_after_s=2.5, nested={"a": [1, (2, 3)]}, obj=object)
    wire = err.to_wire()
    assert wire["code"] == cls.code
    back = from_wire(wire)
    assert type(back) is cls
    assert back.message == "something broke"
    assert back.details["retry_after_s"] == 2.5
    assert back.details["nested"] == {"a": [1, [2, 3]]}
    assert isinstance(back.details["obj"], str)
    assert back.retryable == cls.retryable
    assert back.http_status == cls.http_status
    assert back.to_wire() == wire


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_round_trip_without_message(cls):
    back = from_wire(cls().to_wire())
    assert type(back) is cls and back.message == cls.code


def test_retryable_split():
    assert errors.Unavailable("x", retry_after_s=0.1).retry_after_s == 0.1
    assert errors.Overloaded().retry_after_s == 1.0
    assert errors.NoCapacity().retryable and errors.PeerLost().retryable
    assert not errors.ModelFailed().retryable and not errors.BadRequest().retryable
    assert issubclass(errors.InvalidName, errors.BadRequest)
    assert issubclass(errors.FunctionNotFound, errors.NotFound)


def test_unknown_code_becomes_remote_error():
    back = from_wire({"code": "quantum_flux", "message": "hm", "details": {"k": 1}})
    assert type(back) is RemoteError
    assert back.message == "hm"
    assert back.details["remote_code"] == "quantum_flux"
    assert back.details["k"] == 1


@pytest.mark.parametrize("data", [None, "x", 3, [], {"message": "no code"},
                                  {"code": "bad_request", "details": [1, 2]},
                                  {"code": 5, "message": None}])
def test_malformed_wire(data):
    err = from_wire(data)
    assert isinstance(err, FlashpointError)


def test_from_wire_details_named_message_does_not_raise():
    """BUG: from_wire claims it never raises, but a details key "message" collides with the
    positional ``message`` argument: TypeError."""
    err = from_wire({"code": "bad_request", "message": "m", "details": {"message": "x"}})
    assert isinstance(err, errors.BadRequest)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=100, deadline=None)
@given(code=st.one_of(st.sampled_from([c.code for c in ALL]), st.text(max_size=12)),
       message=json_values, details=json_values)
def test_property_from_wire_never_raises(code, message, details):
    err = from_wire({"code": code, "message": message, "details": details})
    assert isinstance(err, FlashpointError)
