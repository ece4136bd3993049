"""A connection to the daemon: the explicit API (open, close, list, add, stats) plus the heartbeat.

Every call carries a request id and a timeout, so a dead or stuck daemon is a typed
error, never a hang. A DEALER socket (not REQ) keeps the connection usable after a
timeout; late replies to abandoned requests are recognised by id and dropped.

`infer` goes over the daemon's serve lane when it has one (modelcache/lane.py): the same
messages on a plain Unix socket, a few thread wake-ups shorter than ZeroMQ.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import zmq

from .. import lane as _lane, protocol as P
from ..errors import DaemonUnavailable, PermissionDenied, RequestTimeout, from_code


# What the daemon lends on open: the lease, where the weights live and how to read them.
OpenedModel = P.OpenReply


def _settings(socket: str | None, timeout_s: float | None):
    from ..config import load
    overrides = {"socket": socket, "request_timeout_s": timeout_s}
    return load(overrides=overrides)


class Client:
    def __init__(self, socket: str | None = None, timeout_s: float | None = None, name: str = "",
                 lane: bool = True):
        settings = _settings(socket, timeout_s)
        self.address = settings.socket
        # Whose group may read our shared-memory input files: the daemon socket's (see tensors.encode).
        self._group_of = self.address[len("ipc://"):] if self.address.startswith("ipc://") else None
        self.timeout_s = settings.request_timeout_s
        self._add_timeout_s = settings.add_timeout_s
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock = None
        self._lane = None
        self._closed = False
        self._connect()
        hello = self._call(P.Hello(req_id=0, protocol_version=P.PROTOCOL_VERSION, pid=os.getpid(),
                                   client_name=name or Path(os.sys.argv[0] or "python").name),
                           expect=(P.HelloReply,))
        self.client_id = hello.client_id
        self.daemon_version = hello.daemon_version
        self._lane = _lane.connect(self.address) if lane else None   # None: infer goes over ZeroMQ too
        self._heartbeat_stop = threading.Event()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(hello.heartbeat_interval_s,),
                                           name="modelcache-heartbeat", daemon=True)
        self._heartbeat.start()

    # -- transport ---------------------------------------------------------------------
    @property
    def uses_lane(self) -> bool:
        """Whether serve-mode calls go over the serve lane (else ZeroMQ; see modelcache/lane.py)."""
        return self._lane is not None

    def _connect(self) -> None:
        if self.address.startswith("ipc://"):
            check_can_connect(self.address[len("ipc://"):], self.address)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        # The monitor tells us when the daemon's end of the connection goes away (crash, stop).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()  # one for every call (used under the lock): building one cost each call
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def _daemon_gone(self) -> bool:
        from zmq.utils.monitor import recv_monitor_message
        gone = False
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                gone = True
        return gone

    def _call(self, msg, expect: tuple, timeout_s: float | None = None, use_lane: bool = False,
              lane: _lane.LaneClient | None = None, fds: list = ()):
        """Send one request and wait for its reply (or a typed error); over `lane` (with `fds`) when given."""
        if self._closed:
            raise DaemonUnavailable("this modelcache connection is closed")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            msg.req_id = next(self._ids)
            deadline = time.monotonic() + timeout_s
            expect = (*expect, P.ErrorReply)
            if lane is not None:
                reply = self._exchange_lane(msg, expect, deadline, lane, fds)
            elif use_lane and self._lane is not None:
                reply = self._exchange_lane(msg, expect, deadline, self._lane)
            else:
                reply = self._exchange_zmq(msg, expect, deadline)
        if reply is None:
            raise RequestTimeout(f"the modelcache daemon at {self.address} did not answer "
                                 f"{msg.KIND.decode()} within {timeout_s:g} s")
        if isinstance(reply, P.ErrorReply):
            raise from_code(reply.code, reply.message)
        return reply

    def _exchange_zmq(self, msg, expect: tuple, deadline: float):
        """msg's reply over ZeroMQ; None at the deadline."""
        self._sock.send_multipart(P.encode(msg))
        poller = self._poller
        gone = False
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                return None
            events = dict(poller.poll(0 if gone else remaining_ms))
            if self._monitor in events and self._daemon_gone():
                gone = True
            if self._sock not in events:
                if gone:  # and no answer waiting: a daemon that answered, then stopped, did answer
                    raise DaemonUnavailable(f"lost the connection to the modelcache daemon at "
                                            f"{self.address} (it stopped or crashed)")
                continue
            reply = P.decode(self._sock.recv_multipart(), expect=expect)
            if reply.req_id == msg.req_id:
                return reply
            # else: a late answer to a request we gave up on

    def _exchange_lane(self, msg, expect: tuple, deadline: float, lane: _lane.LaneClient, fds: list = ()):
        """msg's reply over a lane; None at the deadline. A serve lane that fails is closed, and
        later calls go over ZeroMQ."""
        try:
            lane.send(*P.encode(msg), deadline, fds)
        except OSError:        # (a send timeout too: part of a frame may be out, the stream is unusable)
            self._drop_lane(lane)
            raise DaemonUnavailable(f"lost the serve lane to the modelcache daemon at {self.address} "
                                    f"(it stopped, crashed or stalled)") from None
        while True:
            try:
                reply = P.decode(lane.receive(deadline), expect=expect)
            except TimeoutError:
                return None    # a late reply, whole or in part, is read and skipped by the next call
            except OSError:
                self._drop_lane(lane)
                raise DaemonUnavailable(f"lost the connection to the modelcache daemon at {self.address} "
                                        f"(it stopped or crashed)") from None
            if reply.req_id == msg.req_id:
                return reply

    def _drop_lane(self, lane: _lane.LaneClient | None = None) -> None:
        if lane is not None and lane is not self._lane:
            lane.close()
        elif self._lane is not None:
            self._lane.close()
            self._lane = None

    def _heartbeat_loop(self, interval_s: float) -> None:
        sock = self._ctx.socket(zmq.DEALER)  # sockets are not thread-safe: the heartbeat has its own
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.connect(self.address)
        try:
            while not self._heartbeat_stop.wait(interval_s):
                try:
                    sock.send_multipart(P.encode(P.Heartbeat(client_id=self.client_id)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # daemon away; requests will say so
        finally:
            sock.close(linger=0)

    # -- API ---------------------------------------------------------------------------
    def open(self, name: str, version: int | None = None, device: str = "cpu") -> OpenedModel:
        """Lease a model: device "cpu" (the host tier) or "cuda" / "cuda:<UUID>" (a GPU copy, by IPC handle)."""
        return self._call(P.Open(req_id=0, client_id=self.client_id, name=name, version=version, device=device),
                          expect=(P.OpenReply,))

    def release(self, lease_id: str) -> None:
        self._call(P.Close(req_id=0, client_id=self.client_id, lease_id=lease_id), expect=(P.Ack,))

    def load(self, name: str, version: int | None = None, tier: str = "host", timeout_s: float | None = None) -> None:
        """Prefetch a model into a tier: "host", "gpu" or "gpu:<UUID or index>" (fetching it from the remote store
        and promoting it through the host tier as need be); returns once resident."""
        self._call(P.Load(req_id=0, name=name, version=version, tier=tier), expect=(P.Ack,),
                   timeout_s=timeout_s or self._add_timeout_s)

    def pin(self, name: str, version: int | None = None, pinned: bool = True) -> None:
        """A pinned model is never evicted (unpin with pinned=False)."""
        self._call(P.Pin(req_id=0, name=name, version=version, pinned=pinned), expect=(P.Ack,))

    def remove(self, name: str, version: int) -> None:
        """Delete a model version from the repository; refused while it is in use."""
        self._call(P.Remove(req_id=0, name=name, version=version), expect=(P.Ack,))

    def describe(self, name: str, version: int | None = None) -> P.DescribeReply:
        """A model's inputs, outputs and stages (no weights are touched)."""
        return self._call(P.Describe(req_id=0, name=name, version=version), expect=(P.DescribeReply,))

    def partition(self, name: str, stages: int | None = None, tail_fraction: float | None = None,
                  version: int | None = None) -> list[dict]:
        """Split a model into stages for serve mode (stages=1 undoes it); returns the stages."""
        return self._call(P.Partition(req_id=0, name=name, version=version, stages=stages,
                                      tail_fraction=tail_fraction), expect=(P.DescribeReply,),
                          timeout_s=self._add_timeout_s).stages

    def infer(self, name: str, feeds: dict, output_names: list | None = None, version: int | None = None,
              deadline_ms: float | None = None) -> tuple[dict, dict]:
        """Serve mode: the daemon runs the model. Returns (name -> output array, timings)."""
        from .. import tensors
        wire, files = tensors.encode(feeds, group_of=self._group_of)
        try:
            reply = self._call(P.Infer(req_id=0, client_id=self.client_id, name=name, inputs=wire, version=version,
                                       output_names=output_names, deadline_ms=deadline_ms), expect=(P.InferReply,),
                               use_lane=True)
        finally:
            for f in files:
                os.unlink(f)
        outputs, _ = tensors.decode(reply.outputs)
        return outputs, reply.timings

    def set_batching(self, name: str, profile: dict, version: int | None = None) -> None:
        """Store a batching calibration with the model (see modelcache.client.calibrate)."""
        self._call(P.SetBatching(req_id=0, name=name, version=version, profile=profile), expect=(P.Ack,))

    def evict(self, name: str, version: int | None = None, tier: str = "host") -> None:
        """Free the model's memory now; it stays on disk. tier="gpu" (or "gpu:<UUID or index>") demotes it
        from the GPU(s) only. Refused (CapacityError) while in use there."""
        self._call(P.Evict(req_id=0, name=name, version=version, tier=tier), expect=(P.Ack,))

    def list(self) -> list[dict]:
        return self._call(P.ListModels(req_id=0), expect=(P.ModelList,)).models

    def stats(self) -> P.StatsReply:
        return self._call(P.Stats(req_id=0), expect=(P.StatsReply,))

    def add(self, path: str, name: str, version: int | None = None, opt_level: str | None = None,
            timeout_s: float | None = None) -> P.AddReply:
        """Pack an .onnx file into the daemon's repository. This process opens the file and each external-data
        file it references, with its own rights (an OSError is its own), and passes the descriptors over a
        lane connection of their own: the daemon never opens a path a client names (see modelcache/sources.py)."""
        from ..sources import close_all, open_model_files
        names, fds = open_model_files(path)
        lane = None
        try:
            lane = _lane.connect(self.address)
            if lane is None:
                raise DaemonUnavailable(f"add needs the daemon's local lane socket ({self.address}.lane): a tcp:// "
                                        "daemon cannot take files; copy the model to its host and add it there")
            return self._call(P.Add(req_id=0, path=os.path.abspath(path), name=name, version=version,
                                    opt_level=opt_level, files=names), expect=(P.AddReply,),
                              timeout_s=timeout_s or self._add_timeout_s, lane=lane, fds=fds)
        finally:
            close_all(fds)
            if lane is not None:
                lane.close()

    def close(self) -> None:
        """Leave: the daemon releases this client's leases at once."""
        if self._closed:
            return
        self._heartbeat_stop.set()
        try:
            self._call(P.Goodbye(req_id=0, client_id=self.client_id), expect=(P.Ack,), timeout_s=2.0)
        except Exception:
            pass  # the daemon will expire our leases anyway
        self._closed = True
        self._drop_lane()
        self._heartbeat.join(timeout=2)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def check_can_connect(path: str, address: str) -> None:
    """Fail at once where the kernel would refuse the connection: libzmq retries a refused ipc:// connect
    in the background, so without this a user outside the socket's group waited for a request timeout."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DaemonUnavailable(f"no modelcache daemon at {address} (no socket file): start one with "
                                "`modelcache daemon`, or point MODELCACHE_SOCKET at the running one") from None
    except PermissionError:
        raise PermissionDenied(f"permission denied: cannot reach the modelcache socket {path}: a directory on its "
                               "path is closed to this user") from None
    if not os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
        raise PermissionDenied(f"permission denied: cannot connect to the modelcache daemon at {address}: the socket "
                               f"is mode {st.st_mode & 0o777:04o}, group {_group_name(st.st_gid)}; ask an admin to add "
                               "this user to that group")


def _group_name(gid: int) -> str:
    import grp
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def connect(socket: str | None = None, timeout_s: float | None = None, name: str = "", lane: bool = True) -> Client:
    """Connect to the daemon at `socket` (default: settings, i.e. MODELCACHE_SOCKET).
    lane=False sends every call over ZeroMQ, serve mode too (the lane is faster; this is for comparing)."""
    return Client(socket, timeout_s, name, lane)


_shared: Client | None = None
_shared_lock = threading.Lock()


def shared_client(socket: str | None = None) -> Client:
    """One connection per process (and per address) for the drop-in sessions, so they share one heartbeat."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._closed or (socket and _shared.address != socket):
            _shared = Client(socket)
        return _shared
