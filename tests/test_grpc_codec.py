"""How the gRPC front reads an infer request off the wire (modelcache/grpc/codec.py read_infer_request): the raw
contents as views of the received bytes, the rest parsed by protobuf, and the request decoded exactly as protobuf's
whole parse would have it; what is not a message fails as protobuf fails."""

from __future__ import annotations

import random

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from modelcache.grpc import codec
from modelcache.triton_protos import grpc_service_pb2 as pb


def request(raw_sizes=(10, 7)) -> pb.ModelInferRequest:
    m = pb.ModelInferRequest(model_name="m", model_version="2", id="r1")
    m.parameters["timeout"].int64_param = 5
    m.parameters["sequence_id"].int64_param = 9
    m.parameters["sequence_start"].bool_param = True
    for k, n in enumerate(raw_sizes):
        t = m.inputs.add(name=f"x{k}", datatype="FP32", shape=[n])
        t.parameters["note"].string_param = "é" * k   # (bytes of every kind around the raw contents)
        m.raw_input_contents.append(np.arange(n, dtype=np.float32).tobytes())
    m.outputs.add(name="y").parameters["classification"].int64_param = 2
    return m


def decoded(msg) -> tuple:
    r = codec.decode_request(msg)
    return (r.name, r.version, r.id, {k: v.tolist() for k, v in r.feeds.items()}, r.output_names, r.timeout_us,
            r.classes, r.sequence, r.priority)


def test_raw_contents_are_views_of_the_received_bytes_and_the_request_decodes_as_protobuf_s():
    data = request().SerializeToString()
    read = codec.read_infer_request(data)
    assert len(read.raws) == 2 and all(isinstance(r, memoryview) and r.obj is data for r in read.raws)
    assert not read.msg.raw_input_contents                      # (not copied into the message as well)
    assert decoded(read) == decoded(pb.ModelInferRequest.FromString(data))
    assert (read.model_name, read.model_version, read.id) == ("m", "2", "r1")


def test_raw_contents_between_other_fields_keep_their_order():
    """protobuf allows a message's fields in any order (a merged message): the raw contents are taken in the order
    they come, and the fields around them parsed whole."""
    first, second = request((3,)), pb.ModelInferRequest()
    second.inputs.add(name="x1", datatype="FP32", shape=[4])
    second.raw_input_contents.append(np.full(4, 7, np.float32).tobytes())
    second.id = "later"
    data = first.SerializeToString() + second.SerializeToString()
    assert decoded(codec.read_infer_request(data)) == decoded(pb.ModelInferRequest.FromString(data))


def test_a_request_without_raw_contents_and_an_empty_one_parse_as_before():
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="INT64", shape=[2]).contents.int64_contents.extend([1, 2])
    read = codec.read_infer_request(typed.SerializeToString())
    assert read.raws is None and decoded(read) == decoded(typed)
    assert codec.read_infer_request(b"").msg == pb.ModelInferRequest()


def test_what_is_not_a_message_fails_as_protobuf_fails_and_cut_messages_alike():
    with pytest.raises(DecodeError):
        codec.read_infer_request(b"\xff\xff\xff")
    data = request().SerializeToString()
    rng = random.Random(0)
    for cut in sorted(rng.sample(range(1, len(data)), 60)) + [len(data) - 1]:
        try:
            expected = decoded(pb.ModelInferRequest.FromString(data[:cut]))
        except Exception as e:   # (a DecodeError, or the decode's own InputError for what parses)
            with pytest.raises(type(e)):
                decoded(codec.read_infer_request(data[:cut]))
        else:
            assert decoded(codec.read_infer_request(data[:cut])) == expected


def test_an_answer_is_written_from_the_output_arrays_and_parses_as_the_whole_message():
    """write_infer_answer: the message's fields, then each raw content from a view of its array; protobuf reads
    it back as the message built whole (raw contents in the outputs' order, an output in a region empty), and a
    stream's answer is that whole message."""
    req = codec.decode_request(request())
    req.output_names = ["big", "region", "s"]
    outputs = {"big": np.arange(300_000, dtype=np.float32).reshape(3, -1)[:, ::3],   # (not contiguous)
               "region": np.ones(4, np.int64), "s": np.array(["x", "yz"], dtype=object)}
    answer = codec.encode_response(req, 2, outputs, in_regions={"region"})
    assert isinstance(answer.raws[0], memoryview)                  # (not copied before it is written)
    back = pb.ModelInferResponse.FromString(codec.write_infer_answer(answer))
    assert back == answer.message()
    assert (back.model_name, back.model_version, back.id) == ("m", "2", "r1")
    assert [o.name for o in back.outputs] == ["big", "region", "s"] and list(back.outputs[0].shape) == [3, 33334]
    big, region, s = back.raw_output_contents
    assert np.array_equal(np.frombuffer(big, np.float32).reshape(3, -1), outputs["big"]) and region == b""
    assert s == b"\x01\x00\x00\x00x\x02\x00\x00\x00yz"


def test_a_stream_answer_is_written_from_the_output_arrays_inside_its_stream_message():
    """write_stream_answer: a ModelStreamInferResponse whose infer_response is the answer written as
    write_infer_answer writes it; an error's response (a message built whole) as protobuf serializes it."""
    req = codec.decode_request(request())
    outputs = {"y": np.arange(200_000, dtype=np.float32), "z": np.ones(3, np.int64)}
    answer = codec.encode_response(req, 1, outputs)
    back = pb.ModelStreamInferResponse.FromString(codec.write_stream_answer(answer))
    assert back.error_message == "" and back.infer_response == codec.encode_response(req, 1, outputs).message()
    assert np.array_equal(np.frombuffer(back.infer_response.raw_output_contents[0], np.float32), outputs["y"])
    error = pb.ModelStreamInferResponse(error_message="nope", infer_response=pb.ModelInferResponse(id="r1"))
    assert codec.write_stream_answer(error) == error.SerializeToString()
