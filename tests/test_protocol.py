import msgpack
import pytest

from modelcache import protocol as P
from modelcache.errors import ProtocolError


def test_roundtrip_every_field():
    msg = P.Open(req_id=7, client_id="c1", name="resnet50", version=2, device="cpu")
    assert P.decode(P.encode(msg)) == msg


def test_optional_field_defaults_when_absent():
    frames = [b"open", msgpack.packb({"req_id": 1, "client_id": "c", "name": "m"})]
    msg = P.decode(frames)
    assert msg.version is None and msg.device == "cpu"


def test_unknown_fields_are_ignored_for_forward_compatibility():
    frames = [b"list", msgpack.packb({"req_id": 3, "added_in_v9": [1, 2]})]
    assert P.decode(frames) == P.ListModels(req_id=3)


@pytest.mark.parametrize("frames, says", [
    ([b"open"], "2 frames"),
    ([b"nope", msgpack.packb({})], "unknown message kind"),
    ([b"open", b"\xc1\xc1garbage"], "not valid msgpack"),
    ([b"open", msgpack.packb([1, 2])], "must be a map"),
    ([b"open", msgpack.packb({"req_id": 1, "client_id": "c"})], "missing field 'name'"),
    ([b"open", msgpack.packb({"req_id": "1", "client_id": "c", "name": "m"})], "open.req_id: expected int"),
    ([b"open", msgpack.packb({"req_id": True, "client_id": "c", "name": "m"})], "expected int"),
    ([b"open", msgpack.packb({"req_id": 1, "client_id": "c", "name": "m", "version": "2"})], "open.version"),
])
def test_malformed_messages_are_clear_protocol_errors(frames, says):
    with pytest.raises(ProtocolError, match=says):
        P.decode(frames)


def test_expect_rejects_other_kinds():
    with pytest.raises(ProtocolError, match="unexpected message 'list'"):
        P.decode(P.encode(P.ListModels(req_id=1)), expect=(P.OpenReply,))


def test_req_id_recovered_from_a_bad_message_when_possible():
    assert P.req_id_of([b"open", msgpack.packb({"req_id": 42})]) == 42
    assert P.req_id_of([b"open", b"\xc1"]) == 0


@pytest.mark.parametrize("entry", [
    {"name": "x", "dtype": "float32", "shape": [2, 2], "data": b"\0" * 8},       # data too short
    {"name": "x", "dtype": "float32", "shape": [-1], "data": b"\0" * 8},         # a negative dim
    {"name": "x", "dtype": "O", "shape": [2], "data": b"\0" * 16},               # pointers from the wire
    {"name": "x", "dtype": {"names": ["a"], "formats": ["O"]}, "shape": [1], "data": b"\0" * 8},
    {"name": "x", "dtype": "no-such-type", "shape": [1], "data": b"\0" * 4},
    {"name": "x", "dtype": "float32", "shape": "1", "data": b"\0" * 4},
    {"name": "x", "dtype": "float32", "shape": [1]},                              # neither data nor shm
    {"name": "x", "dtype": "float32", "shape": [10**30], "data": b"\0" * 8},     # past what a size can hold
    {"name": "x", "dtype": "float32", "shape": [2**40, 2**40], "data": b"\0" * 8},
])
def test_malformed_tensors_are_protocol_errors(entry):
    from modelcache import tensors
    with pytest.raises(ProtocolError, match="malformed tensor"):
        tensors.decode([entry])


def test_tensors_roundtrip_read_only():
    import numpy as np
    from modelcache import tensors
    feeds = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros((0, 4), np.int64)}
    wire, files = tensors.encode(feeds)
    out, maps = tensors.decode(msgpack.unpackb(msgpack.packb(wire)))
    assert not files and not maps
    for k, v in feeds.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and not out[k].flags.writeable
        np.testing.assert_array_equal(out[k], v)
