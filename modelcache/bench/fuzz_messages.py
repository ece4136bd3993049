"""Malformed messages for the daemon's two sockets, made from a random.Random: pure, no I/O.

Shared by the property-based tests (hypothesis hands in its own Random, so a failing case
shrinks) and `modelcache bench fuzz` (a seeded Random, for the long run). Most messages are
"valid-ish": a real kind whose map has the real field names, each field kept plausible or
replaced by a hostile value, so the fuzz reaches the handlers and not only the decoder.
Values are built as msgpack bytes directly, which lets a body hold what msgpack.packb
would refuse to make (nesting past its recursion limit, reserved bytes inside a map).
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field

import msgpack

from ..wire import protocol as P
from ..wire.lane import HEADER, frame

REQUESTS = [cls for cls in P.MESSAGES.values() if not cls.KIND.endswith(b"_ok") and cls.KIND not in (b"ok", b"error")]
REPLIES = [cls for cls in P.MESSAGES.values() if cls not in REQUESTS]
# What a request is answered with when it is accepted (anything else must be an ErrorReply).
# (load, pin and evict: Ack, or a ModelOutcome when the request asks for one)
REPLY_TO = {b"hello": (b"hello_ok",), b"bye": (b"ok",), b"open": (b"open_ok",), b"close": (b"ok",),
            b"load": (b"ok", b"outcome_ok"), b"pin": (b"ok", b"outcome_ok"), b"remove": (b"ok",),
            b"evict": (b"ok", b"outcome_ok"), b"list": (b"list_ok",), b"add": (b"add_ok",),
            b"describe": (b"describe_ok",), b"set_batching": (b"ok",), b"configure": (b"ok",),
            b"set_unloaded": (b"ok",), b"log_settings": (b"log_settings_ok",),
            b"partition": (b"describe_ok",), b"infer": (b"infer_ok",), b"stats": (b"stats_ok",),
            b"profile": (b"profile_ok",), b"verify": (b"verify_ok",), b"front_served": (b"front_served_ok",)}
# Kinds that mutate the repository: they never name the target's model, which the fuzz needs intact
# for the deeper paths (a `remove` of it would turn every later infer into "not found"; a `configure` could make
# it a stateful model, whose infers need a sequence).
DESTRUCTIVE = (b"remove", b"configure")

INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 10**7, 65536, -65536]
FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, -1.0, 0.5]
STRINGS = ["", "\x00", "x" * 255, "x" * 70000, "../../etc/passwd", "é\u202e", "cuda", "gpu:99", "host", "%s%n"]
DTYPES = ["float32", "float64", "float16", "int64", "int8", "bool", "object", "<U4", "V8", "complex64", "", "str"]


@dataclass
class FuzzTarget:
    """What the generator may name: the daemon's models and the fuzzer's own clients and files."""
    model: str = "fuzz"                      # a model the fuzz may evict, pin, partition, infer
    names: list = field(default_factory=lambda: ["fuzz", "nope", "", "../fuzz", "x" * 300])
    client_ids: list = field(default_factory=lambda: ["", "nobody"])
    io_paths: list = field(default_factory=lambda: ["/dev/shm/modelcache-io.nope", "/etc/passwd", "/dev/zero",
                                                    "/proc/self/mem", "relative", "/dev/shm/../shm/modelcache-io.x"])
    add_paths: list = field(default_factory=lambda: ["/nonexistent/model.onnx", "", "relative.onnx"])


def packed(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def noise(rng: random.Random, n: int) -> bytes:
    """n random bytes from one draw of `rng`: hypothesis's Random records every byte of a randbytes(n) as a
    choice of its own, which cost the lane fuzz test 29 of its 31 s; the bytes' values are not worth shrinking."""
    return random.Random(rng.getrandbits(64)).randbytes(n)


def array_of(n: int, item: bytes = b"\x00") -> bytes:
    """A msgpack array of n one-byte items: a body that would inflate ~17x if unpacked naively."""
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def map_of(fields: dict) -> bytes:
    """A msgpack map from name -> already-packed value (so values may be anything, even broken)."""
    n = len(fields)
    head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return head + b"".join(packed(k) + v for k, v in fields.items())


def hostile_value(rng: random.Random, depth: int = 0) -> bytes:
    """One msgpack value a field should never hold."""
    pick = rng.randrange(13)
    if pick == 0:
        return packed(rng.choice(INTS))
    if pick == 1:
        return packed(rng.choice(FLOATS))
    if pick == 2:
        return packed(rng.choice(STRINGS))
    if pick == 3:
        return packed(noise(rng, rng.choice([0, 1, 16, 4096])))
    if pick == 4:
        return packed(rng.choice([None, True, False]))
    if pick == 5:       # deep nesting, past what packb (and a naive recursive reader) would take
        d = rng.choice([10, 600, 5000])
        return b"\x91" * d + b"\xc0"
    if pick == 6:       # a big array, just under and over the daemon's per-request item bound
        return array_of(rng.choice([1000, 60000, 70000]))
    if pick == 7:       # a header that promises more than the body holds
        return rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdb\x7f\xff\xff\xff", b"\xc6\x7f\xff\xff\xff", b"\xdf\x00\x01"])
    if pick == 8:
        return b"\xc1"  # never used in msgpack
    if pick == 9:       # an extension type
        return b"\xd4\x01\x00" if rng.random() < 0.5 else b"\xd6\xff" + struct.pack(">I", rng.getrandbits(32))
    if pick == 10 and depth < 3:
        return b"\x92" + hostile_value(rng, depth + 1) + hostile_value(rng, depth + 1)
    if pick == 11 and depth < 3:
        return map_of({rng.choice(STRINGS[:3] + ["name", "shape"]): hostile_value(rng, depth + 1)})
    return packed(rng.uniform(-1e300, 1e300))


def tensor_entry(rng: random.Random, target: FuzzTarget) -> bytes:
    """An input tensor of serve mode (see modelcache.wire.tensors) with some of its parts made wrong."""
    shape = rng.choice([[1, 3, 32, 32], [2, 3, 32, 32], [], [0], [-1, 3], [2**40, 2**40], [1] * 40,
                        [rng.randrange(-5, 70000)], ["a"], [1.5]])
    dtype = rng.choice(DTYPES)
    entry = {"name": packed(rng.choice(["input", "", "logits", "x" * 300])), "dtype": packed(dtype),
             "shape": packed(shape)}
    if rng.random() < 0.6:
        entry["data"] = packed(noise(rng, rng.choice([0, 7, 12288, 24576])))
    else:
        entry["shm"] = packed(rng.choice(target.io_paths))
        entry["nbytes"] = packed(rng.choice([12288, 0, -1, 2**63 - 1, 2**64 - 1]))
    for key in list(entry):
        roll = rng.random()
        if roll < 0.05:
            del entry[key]
        elif roll < 0.15:
            entry[key] = hostile_value(rng)
    return map_of(entry)


def plausible_value(rng: random.Random, kind: bytes, name: str, type_text: str, target: FuzzTarget,
                    req_id: int) -> bytes:
    """A value of the right type and often the right meaning, so the message gets past decode."""
    if name == "req_id":
        return packed(req_id)
    if name == "client_id":
        return packed(rng.choice(target.client_ids))
    if name == "name":
        names = [n for n in target.names if n != target.model] if kind in DESTRUCTIVE else target.names
        return packed(rng.choice(names))
    if name == "path":
        return packed(rng.choice(target.add_paths))
    if name == "pid":
        return packed(rng.choice([0, 1, 2**31, 2**63 - 1, -5, 4194304, 4194305]))
    if name == "protocol_version":
        return packed(rng.choice([P.PROTOCOL_VERSION, P.PROTOCOL_VERSION, 0, 2**40]))
    if name == "inputs":
        n = rng.choice([0, 1, 1, 2, 300])
        return (b"\x90" if n == 0 else b"\xdc" + n.to_bytes(2, "big")) + b"".join(
            tensor_entry(rng, target) for _ in range(n))
    if name == "stages":
        return packed(rng.choice([None, 0, 1, 2, 65, -3, 10**7, 2**63 - 1]))
    if name in ("tail_fraction", "deadline_ms"):
        return packed(rng.choice([None, 0.0, 0.3, 1.0, math.nan, math.inf, -1.0, 1e-300]))
    if name in ("tier", "device"):
        return packed(rng.choice(["host", "gpu", "cpu", "cuda", "gpu:0", "cuda:GPU-x", "disk", ""]))
    if name == "profile":
        keys = ["kind", "batches", "stage_s", "ratios", "g", "t_opt_ms", "n_opt", "request_s", "extra"]
        return map_of({k: hostile_value(rng) for k in rng.sample(keys, rng.randrange(len(keys) + 1))})
    if type_text.startswith("Optional") or name in ("version", "output_names"):
        return packed(rng.choice([None, 1, 2, 0, -1, 2**64 - 1]) if name == "version"
                      else rng.choice([None, ["logits"], ["nope"], [], [1]]))
    return {"int": lambda: packed(rng.choice(INTS)), "float": lambda: packed(rng.choice(FLOATS)),
            "str": lambda: packed(rng.choice(STRINGS)), "bool": lambda: packed(rng.random() < 0.5),
            "list": lambda: packed([]), "dict": lambda: packed({})}[type_text]()


def request_body(rng: random.Random, cls: type, target: FuzzTarget, req_id: int) -> bytes:
    """A request map of `cls`: each field plausible, hostile, missing, and sometimes extra ones."""
    fields = {}
    for name, type_text, _accept, _optional, _default in cls.CHECKS:
        roll = rng.random()
        if roll < 0.08:
            continue                                    # missing (fatal only where required)
        if roll < 0.3 and name != "req_id":
            fields[name] = hostile_value(rng)
        else:
            fields[name] = plausible_value(rng, cls.KIND, name, type_text, target, req_id)
    if rng.random() < 0.1:
        fields[rng.choice(["extra", "req_id ", "\x00", "x" * 1000])] = hostile_value(rng)
    return map_of(fields)


@dataclass
class Fuzzed:
    """One malformed message: its frames (ZeroMQ) and the request id it was sent with, if any."""
    frames: list
    req_id: int | None = None   # None: no reply expected to carry it (garbage, bad framing, heartbeat)
    kind: bytes = b""


def zmq_message(rng: random.Random, target: FuzzTarget, req_id: int) -> Fuzzed:
    """One message for the ROUTER socket."""
    roll = rng.random()
    if roll < 0.7:
        cls = rng.choice(REQUESTS)
        body = request_body(rng, cls, target, req_id)
        return Fuzzed([cls.KIND, body], req_id if cls is not P.Heartbeat else None, cls.KIND)
    if roll < 0.76:                             # a reply where a request belongs
        cls = rng.choice(REPLIES)
        return Fuzzed([cls.KIND, map_of({"req_id": packed(req_id)})], req_id, cls.KIND)
    if roll < 0.82:                             # a kind nobody knows
        return Fuzzed([rng.choice([b"", b"teleport", noise(rng, rng.choice([1, 40, 300])), b"HELLO", b"hello\x00"]),
                       map_of({"req_id": packed(req_id)})], req_id)
    if roll < 0.9:                              # wrong number of frames
        kind = rng.choice(REQUESTS).KIND
        frames = rng.choice([[kind], [], [kind, packed({"req_id": req_id}), b"extra"],
                             [kind, b"", b"", b"", b"", b""], [b""] * rng.randrange(1, 50)])
        return Fuzzed(frames or [b""])
    cls = rng.choice(REQUESTS)                  # a body that is not a map of fields
    good = request_body(rng, cls, target, req_id)
    body = rng.choice([noise(rng, rng.randrange(0, 200)), good[:cut_point(rng, len(good))],
                       packed([req_id]), packed(req_id), b"\x91" * 100_000 + b"\xc0", hostile_value(rng),
                       b"\x82" + packed("req_id") + packed(req_id) + packed(1) + packed(2)])   # an int key
    return Fuzzed([cls.KIND, body], None, cls.KIND)


def cut_point(rng: random.Random, n: int, low: int = 0) -> int:
    """Where to cut n bytes short: in [low, n), or low when n <= low. Drawn as a fraction, so the draw's
    bounds do not depend on n: n grows with the req_id's msgpack encoding, which differs when hypothesis
    replays a case, and a draw whose bounds moved failed a whole test run (FlakyStrategyDefinition)."""
    return low + int(rng.random() * max(0, n - low))


def lane_bytes(rng: random.Random, target: FuzzTarget, req_id: int) -> tuple[bytes, list]:
    """What one lane connection sends before it half-closes: (bytes, the messages in whole frames)."""
    roll = rng.random()
    if roll < 0.6:                              # whole frames of fuzzed messages, one or a few back to back
        messages = [zmq_message(rng, target, req_id + i) for i in range(rng.choice([1, 1, 3]))]
        messages = [m for m in messages if len(m.frames) == 2 and 0 < len(m.frames[0]) < 256]   # what a frame holds
        return b"".join(frame(*m.frames) for m in messages), messages
    if roll < 0.75:                             # a frame cut short
        m = zmq_message(rng, target, req_id)
        if len(m.frames) != 2 or not 0 < len(m.frames[0]) < 256:
            return b"\x05", []
        data = frame(*m.frames)
        return data[:cut_point(rng, len(data), 1)], []
    if roll < 0.9:                              # a header that cannot be right
        return rng.choice([HEADER.pack(0, 10) + b"x" * 10, HEADER.pack(5, 2**32 - 1) + b"infer",
                           HEADER.pack(255, 0) + b"k" * 255, HEADER.pack(5, 2**31) + b"infer" + b"\x80" * 100,
                           HEADER.pack(5, 1) + b"infer"]), []
    return noise(rng, rng.choice([1, 5, 100, 70000])), []
