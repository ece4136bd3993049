import msgpack
import pytest

from modelcache.errors import ProtocolError
from modelcache.wire import protocol as P


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
    ([b"infer", msgpack.packb({"req_id": 1, "client_id": "", "name": "m", "inputs": [], "priority": -1})],
     r"priority -1: must be within 0..2\^64-1"),
    ([b"infer", msgpack.packb({"req_id": 1, "client_id": "", "name": "m", "inputs": [], "priority": "high"})],
     "infer.priority: expected int"),
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
    from modelcache.wire import tensors
    with pytest.raises(ProtocolError, match="malformed tensor"):
        tensors.decode([entry])


def test_tensors_roundtrip_read_only():
    import numpy as np
    from modelcache.wire import tensors
    feeds = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros((0, 4), np.int64)}
    wire, files = tensors.encode(feeds)
    out, maps = tensors.decode(msgpack.unpackb(msgpack.packb(wire)))
    assert not files and not maps
    for k, v in feeds.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and not out[k].flags.writeable
        np.testing.assert_array_equal(out[k], v)


def _open_reply(tensors: list, **kw) -> list[bytes]:
    return P.encode(P.OpenReply(req_id=1, lease_id="l1", name="m", version=1, skeleton_path="/s",
                                segments=["/dev/shm/a"], tensors=tensors, **kw))


def test_tensor_placements_decode_into_named_checked_records():
    reply = P.decode(_open_reply([["w", "float32", [2, 3], 0, 4096, 24], ["b", "int64", [3], 0, 8192, 24]]))
    w, b = reply.tensors
    assert isinstance(w, P.TensorPlacement) and (w.name, w.dtype, w.shape, w.index, w.offset, w.nbytes) == \
        ("w", "float32", [2, 3], 0, 4096, 24)
    assert list(b) == ["b", "int64", [3], 0, 8192, 24]    # positional on the wire, as before


@pytest.mark.parametrize("row, says", [
    (["w", "float32", [2, 3], 0, 0], "malformed"),
    (["w", "float32", [2, -3], 0, 0, 24], "non-negative"),
    (["w", "float32", "23", 0, 0, 24], "non-negative"),
    (["w", "float32", [2, 3], 0, 0, 25], "not 25 bytes"),
    (["w", "float32", [2, 3], 0, 2, 24], "aligned"),
    (["w", "float32", [2, 3], 1, 0, 24], "index 1 out of range"),   # one segment
    ("w", "malformed"),
])
def test_a_malformed_tensor_placement_is_refused_when_the_open_reply_is_decoded(row, says):
    with pytest.raises(ProtocolError, match=says):
        P.decode(_open_reply([row]))


def test_a_gpu_leases_placements_index_its_handles():
    frames = _open_reply([["w", "float16", [4], 1, 0, 8]], device_uuid="GPU-x", ipc_kind="fake", ipc_handles=[b"a", b"b"])
    assert P.decode(frames).tensors[0].index == 1
    frames = _open_reply([["w", "float16", [4], 2, 0, 8]], device_uuid="GPU-x", ipc_kind="fake", ipc_handles=[b"a", b"b"])
    with pytest.raises(ProtocolError, match="out of range"):
        P.decode(frames)



@pytest.mark.parametrize("ipc_fds, kw, ok", [
    (2, {}, True),                               # a host lease: its portable skeleton, then its one segment
    (1, {}, False), (3, {}, False), (-1, {}, False),
    (2, {"device_uuid": "GPU-x", "ipc_kind": "fake-vmm", "ipc_handles": [b"a", b"b"]}, True),   # one per handle
    (3, {"device_uuid": "GPU-x", "ipc_kind": "fake-vmm", "ipc_handles": [b"a", b"b"]}, False),
])
def test_an_open_reply_declares_the_descriptors_its_lease_has(ipc_fds, kw, ok):
    frames = _open_reply([["w", "float16", [4], 0, 0, 8]], ipc_fds=ipc_fds, **kw)
    if ok:
        assert P.decode(frames).ipc_fds == ipc_fds
    else:
        with pytest.raises(ProtocolError, match="file descriptors"):
            P.decode(frames)

@pytest.mark.parametrize("ipc_fds, lent_fds, ok", [(0, 0, True), (3, 1, True), (1, 1, True), (1, 2, False),
                                                   (0, 1, False), (2, -1, False)])
def test_an_infer_lends_only_descriptors_it_passes(ipc_fds, lent_fds, ok):
    """Infer.lent_fds: the last of its ipc_fds, lent for the answer's large outputs (wire/lent_outputs.py)."""
    frames = list(P.encode(P.Infer(req_id=1, client_id="", name="m", inputs=[], ipc_fds=ipc_fds, lent_fds=lent_fds)))
    if ok:
        assert P.decode(frames).lent_fds == lent_fds
    else:
        with pytest.raises(ProtocolError, match="lent_fds"):
            P.decode(frames)


# -- batching profiles, placement plans and timings: decoded into their records, checked once -----------

PROFILE = {"kind": "cpu2", "batches": [1, 4], "stage_s": [[0.001, 0.002], [0.003, 0.004]],
           "ratios": [[1.0, 1.0], [1.0, 1.0]], "g": [0.001, 0.0007, 2.0, 2.0], "t_opt_ms": 50.0, "n_opt": 4}
PLAN = {"format": 1, "model": "cnn@1", "nodes": 5,
        "stages": [{"start": 0, "end": 2, "worker_names": ["cpu-0"], "first_node": "a", "last_node": "b"},
                   {"start": 2, "end": 5, "worker_names": ["cpu-1"], "first_node": "c", "last_node": "e"}]}


def roundtrip(msg):
    return P.decode(P.encode(msg))


def test_a_batching_profile_decodes_into_a_checked_record_with_its_stage_count():
    msg = roundtrip(P.SetBatching(req_id=1, name="m", profile=PROFILE))
    assert isinstance(msg.profile, P.BatchingProfile) and msg.profile == PROFILE and msg.profile.stages == 2


@pytest.mark.parametrize("change, says", [
    ({"n_opt": 0}, "n_opt"),
    ({"stage_s": [[0.001], [0.003, 0.004]]}, "stage_s"),
    ({"stage_s": [[0.0] * 65, [0.0] * 65]}, "1 to 64 stages"),
    ({"extra": 1}, "unknown field"),
])
def test_a_malformed_profile_is_the_callers_input_error(change, says):
    from modelcache.errors import InputError, from_code
    with pytest.raises(ProtocolError, match=says) as e:
        roundtrip(P.SetBatching(req_id=1, name="m", profile={**PROFILE, **change}))
    assert isinstance(from_code(e.value.code, str(e.value)), InputError)   # what the client raises


@pytest.mark.parametrize("kind", [P.Add, P.Configure])
@pytest.mark.parametrize("declared, says", [
    ({"serving": {"policy": "dynamic", "max_batch": -1}}, "max_batch must be a whole number"),
    ({"model_config": ["max_batch_size", 4]}, "model_config: expected dict"),
    ({"labels": {"logits": "cat,dog"}}, "labels must map output names to lists of strings"),
])
def test_what_a_model_declares_is_checked_as_it_is_decoded(kind, declared, says):
    """Add and Configure carry the same declared configuration, checked by one rule."""
    fields = {"path": "m.onnx"} if kind is P.Add else {"version": 1}
    with pytest.raises(ProtocolError, match=says):
        roundtrip(kind(req_id=1, name="m", **fields, **declared))
    ok = roundtrip(kind(req_id=1, name="m", **fields, serving={"policy": "dynamic", "max_batch": 4},
                        labels={"logits": ["cat", "dog"]}))
    assert ok.serving["max_batch"] == 4 and ok.labels == {"logits": ["cat", "dog"]}


def test_a_placement_plan_decodes_into_a_checked_record():
    msg = roundtrip(P.Partition(req_id=1, name="m", plan=PLAN))
    assert isinstance(msg.plan, P.PlacementPlan) and msg.plan == PLAN
    assert roundtrip(P.Partition(req_id=1, name="m", stages=2)).plan is None


@pytest.mark.parametrize("plan, says", [
    ({**PLAN, "nodes": "5"}, "nodes"),
    ({**PLAN, "stages": "all"}, "list of 1 to 5 stages"),
    ({**PLAN, "stages": [7]}, "stage 0 is not a map"),
    ({**PLAN, "stages": [{"start": 0, "end": 2}, {"start": 3, "end": 5}]}, "stage 1: start and end"),
    ({**PLAN, "stages": [{"start": 0, "end": 9}]}, "stage 0: start and end"),
    ({**PLAN, "stages": [{"start": 0, "end": 5, "worker_names": "cpu-0"}]}, "worker_names"),
    ({**PLAN, "stages": [{"start": 0, "end": 5, "last_node": 3}]}, "last_node"),
])
def test_a_malformed_plan_is_refused_as_it_is_decoded(plan, says):
    with pytest.raises(ProtocolError, match=says) as e:
        roundtrip(P.Partition(req_id=1, name="m", plan=plan))
    assert e.value.code == "input"


def test_timings_decode_into_records_and_malformed_ones_are_protocol_errors():
    stage = {"stage": 0, "worker": 1, "kind": "cpu1", "batch": 1, "wait_ms": 0.1, "run_ms": 2.0, "inline": False,
             "predicted_ms": None}
    msg = roundtrip(P.InferReply(req_id=1, outputs=[], timings={"queue_ms": 0.1, "total_ms": 2.5, "stages": [stage]}))
    assert isinstance(msg.timings, P.Timings) and isinstance(msg.timings["stages"][0], P.StageTiming)
    assert msg.timings["stages"][0]["run_ms"] == 2.0 and msg.timings["total_ms"] == 2.5
    for bad in ({"stages": "x"}, {"total_ms": -1}, {"stages": [{"stage": "0", "wait_ms": 0, "run_ms": 0}]}):
        with pytest.raises(ProtocolError, match="timing"):
            roundtrip(P.InferReply(req_id=1, outputs=[], timings=bad))
