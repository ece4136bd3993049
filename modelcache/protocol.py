"""Every message between clients and the daemon: typed, versioned, declared here and nowhere else.

On the wire a message is two ZeroMQ frames: its kind (ASCII) and a msgpack map of its
fields. A receiver decodes into the type it expects and rejects anything else with a
ProtocolError. Messages evolve by adding fields at the end, with defaults; unknown
fields are ignored so that an older daemon still understands a newer client.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack

from .errors import ProtocolError

PROTOCOL_VERSION = 1

MESSAGES: dict[bytes, type] = {}


def message(kind: str):
    def register(cls):
        cls = dataclass(cls)
        cls.KIND = kind.encode()
        MESSAGES[cls.KIND] = cls
        return cls
    return register


# -- handshake and liveness ------------------------------------------------------------

@message("hello")
class Hello:
    req_id: int
    protocol_version: int
    pid: int
    client_name: str = ""


@message("hello_ok")
class HelloReply:
    req_id: int
    protocol_version: int
    daemon_version: str
    client_id: str
    heartbeat_interval_s: float
    lease_timeout_s: float


@message("heartbeat")
class Heartbeat:
    """Fire and forget: keeps the client's leases alive."""
    client_id: str


@message("bye")
class Goodbye:
    """The client is leaving: release all its leases now rather than at lease expiry."""
    req_id: int
    client_id: str


# -- models ------------------------------------------------------------------------------

@message("open")
class Open:
    req_id: int
    client_id: str
    name: str
    version: Optional[int] = None
    device: str = "cpu"


@message("open_ok")
class OpenReply:
    req_id: int
    lease_id: str
    name: str
    version: int
    skeleton_path: str                 # the weightless graph, in the host tier
    weights_path: str                  # the weights blob clients map read-only
    tensors: list = field(default_factory=list)   # [name, dtype, shape, offset, nbytes] each
    inputs: list = field(default_factory=list)    # [{name, dtype, shape}]
    outputs: list = field(default_factory=list)
    weights_bytes: int = 0
    hit: bool = True                   # was it resident before this open?


@message("close")
class Close:
    req_id: int
    client_id: str
    lease_id: str


@message("ok")
class Ack:
    req_id: int


@message("list")
class ListModels:
    req_id: int


@message("list_ok")
class ModelList:
    req_id: int
    models: list = field(default_factory=list)   # dicts, see daemon.registry.ModelRecord.describe


@message("add")
class Add:
    req_id: int
    path: str
    name: str
    version: Optional[int] = None
    opt_level: Optional[str] = None


@message("add_ok")
class AddReply:
    req_id: int
    name: str
    version: int
    weights_bytes: int
    tensors: int
    pack_s: float


@message("stats")
class Stats:
    req_id: int


@message("stats_ok")
class StatsReply:
    req_id: int
    daemon_version: str
    pid: int
    uptime_s: float
    socket: str
    clients: list = field(default_factory=list)
    models: list = field(default_factory=list)
    tiers: list = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    jobs: list = field(default_factory=list)      # in-flight packs and loads, with progress


@message("error")
class ErrorReply:
    req_id: int
    code: str
    message: str


# -- encoding ----------------------------------------------------------------------------

def encode(msg) -> list[bytes]:
    return [msg.KIND, msgpack.packb(dataclasses.asdict(msg), use_bin_type=True)]


_PLAIN = {int: (int,), float: (int, float), str: (str,), bool: (bool,), list: (list, tuple), dict: (dict,)}


def _check(cls, name: str, typ, value) -> None:
    origin = typing.get_origin(typ)
    if origin is typing.Union:  # Optional[X]
        if value is None:
            return
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    elif origin is not None:
        typ = origin
    ok = _PLAIN.get(typ, (object,))
    if not isinstance(value, ok) or (typ in (int, float) and isinstance(value, bool)):
        raise ProtocolError(f"{cls.KIND.decode()}.{name}: expected {typ.__name__}, got {type(value).__name__}")


def decode(frames: list[bytes], expect: tuple[type, ...] | None = None) -> Any:
    """Two frames -> the message object; ProtocolError says exactly what is wrong."""
    if len(frames) != 2:
        raise ProtocolError(f"a message is 2 frames (kind, body), got {len(frames)}")
    kind, body = frames
    cls = MESSAGES.get(bytes(kind))
    if cls is None:
        raise ProtocolError(f"unknown message kind {bytes(kind)[:40]!r}")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message {cls.KIND.decode()!r}; expected one of "
                            f"{', '.join(c.KIND.decode() for c in expect)}")
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"{cls.KIND.decode()}: body is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.KIND.decode()}: body must be a map, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            _check(cls, f.name, hints[f.name], data[f.name])
            kwargs[f.name] = data[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ProtocolError(f"{cls.KIND.decode()}: missing field {f.name!r}")
    return cls(**kwargs)


def req_id_of(frames: list[bytes]) -> int:
    """Best-effort request id of a message that failed to decode, so the error still finds its caller."""
    try:
        rid = msgpack.unpackb(frames[-1], raw=False).get("req_id", 0)
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:
        return 0
