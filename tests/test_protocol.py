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
