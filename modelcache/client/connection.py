"""A connection to the daemon: the explicit API (open, close, list, add, stats) plus the heartbeat.

Every call carries a request id and a timeout, so a dead or stuck daemon is a typed
error, never a hang. Requests go through the request core (client/rpc.py) on two channels:
ZeroMQ (a DEALER socket, not REQ, so the connection stays usable after a timeout) for
hello, open and admin, and the daemon's serve lane for `infer` when it has one
(modelcache/wire/lane.py: the same messages on a plain Unix socket, a few thread wake-ups
shorter than ZeroMQ). The core matches replies by id, so any number of threads may have
calls in flight at once (their serve requests can batch together in the daemon), and late
replies to abandoned requests are dropped, whatever their kind.

A restarted daemon is found again without the caller's help: when the daemon goes away
(a call's socket monitor, the heartbeat's, or an "unknown client" answer), the client
connects anew, says hello, and re-opens the leases of the sessions still open (their
mappings never stopped working; the new lease keeps the daemon's eviction accounting
right). The heartbeat thread retries with backoff while the daemon is away; a call made
meanwhile fails at once with DaemonUnavailable, and a call the outage cut short is sent
again once if the daemon is already back and the call is safe to repeat.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import time
import weakref
from pathlib import Path

import zmq

import logging

from ..address import check_can_connect, check_listening
from ..errors import DaemonUnavailable, ModelCacheError, RequestTimeout, from_code
from ..wire import lane as _lane, protocol as P
from .lease_keeper import LeaseKeeper
from .input_buffers import InputBuffers
from .rpc import Channel, answer_within_ms, infer_call, lane_connection

log = logging.getLogger("modelcache.client")
# Calls a restarted daemon may safely see twice: the dead daemon's effects died with it.
RETRY_SAFE = (P.Open, P.Close, P.ListModels, P.Stats, P.Describe, P.Infer, P.Load, P.Profile)
RECONNECT_BACKOFF_S = (0.05, 2.0)     # the heartbeat's first retry, and the longest wait between retries
HELLO_TIMEOUT_S = 5.0


# What the daemon lends on open: the lease, where the weights live and how to read them.
OpenedModel = P.OpenReply


def _settings(socket: str | None, timeout_s: float | None):
    from ..config import CLIENT_SETTINGS, load
    overrides = {"socket": socket, "request_timeout_s": timeout_s}
    return load(overrides=overrides, only=CLIENT_SETTINGS,
                overrides_are="arguments")   # (a daemon-only setting never breaks a client)


class ZmqConnection:
    """A DEALER socket behind the request core's connection interface (send, receive_all, shutdown, close).

    ZeroMQ sockets are not thread-safe: the thread reading for everyone (the core's leader) owns
    the socket while it polls, and a sender that finds it owned queues its frames and wakes the
    owner through a pipe, which sends them. A lone caller owns it at once: no extra hop."""

    def __init__(self, ctx: zmq.Context, address: str):
        if address.startswith("ipc://"):
            check_can_connect(address[len("ipc://"):], address)
            check_listening(address[len("ipc://"):], address)
        self.address = address
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        # The monitor tells us when the daemon's end of the connection goes away (crash, stop).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        for what in (self._sock, self._monitor, self._wake_r):
            self._poller.register(what, zmq.POLLIN)
        self._owner = threading.Lock()
        self._outbox: collections.deque = collections.deque()
        self._gone = False
        self._closing = False
        self._closed = False

    def send(self, kind: bytes, body: bytes, deadline: float, fds=()) -> None:
        if self._closing:
            raise ConnectionError("this connection is closed")
        self._outbox.append((kind, body))
        if self._owner.acquire(False):
            try:
                self._flush()
            finally:
                self._owner.release()
        else:
            self._wake()

    def receive_all(self, deadline: float) -> list:
        """Every reply there is, waiting until the deadline for the first; [] then. ConnectionError when
        the daemon's end went away with nothing left to read (a daemon that answered, then stopped, did answer)."""
        with self._owner:
            try:
                while not self._closing:
                    self._flush()
                    remaining_ms = int((deadline - time.monotonic()) * 1000)
                    events = dict(self._poller.poll(0 if self._gone else max(0, remaining_ms)))
                    if self._wake_r in events:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            pass
                    if self._monitor in events and self._daemon_gone():
                        self._gone = True
                    out = []
                    if self._sock in events:   # (EVENTS rather than catching zmq.Again: an exception costs us)
                        while self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                            out.append(self._sock.recv_multipart(zmq.NOBLOCK))
                    if out:
                        return out
                    if self._gone:
                        raise ConnectionError("the daemon went away")
                    if remaining_ms <= 0:
                        return []
                raise ConnectionError("this connection is closed")
            except zmq.ZMQError as e:
                raise ConnectionError(str(e)) from None
            finally:
                if self._closing:
                    self._close_now()

    def _flush(self) -> None:
        """(The owner.) Send what other threads queued."""
        try:
            while self._outbox:
                self._sock.send_multipart(self._outbox.popleft())
        except zmq.ZMQError as e:
            raise ConnectionError(str(e)) from None

    def _daemon_gone(self) -> bool:
        from zmq.utils.monitor import recv_monitor_message
        gone = False
        while self._monitor.poll(0):
            if recv_monitor_message(self._monitor)["event"] == zmq.EVENT_DISCONNECTED:
                gone = True
        return gone

    def peer_gone(self) -> bool:
        """Whether this connection's own monitor saw the daemon go; looked at only when no thread reads
        it (one that does finds out by itself)."""
        if not self._gone and self._owner.acquire(False):
            try:
                if not self._closing and self._daemon_gone():
                    self._gone = True
            finally:
                self._owner.release()
        return self._gone

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass   # a wake-up is pending already (or the pipe is closed: so is the connection)

    def shutdown(self) -> None:
        self._closing = True
        self._wake()

    def close(self) -> None:
        """Closed by the owner if one polls it now (a socket is closed by the thread that holds it)."""
        self._closing = True
        self._wake()
        with self._owner:   # an owner wakes at once, sees _closing and lets go
            self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)   # with it go requests queued for the dead daemon: no strays later
        os.close(self._wake_r)
        os.close(self._wake_w)


class Client:
    def __init__(self, socket: str | None = None, timeout_s: float | None = None, name: str = "",
                 lane: bool = True):
        settings = _settings(socket, timeout_s)
        self.address = settings.socket
        # Whose group may read our shared-memory input files: the daemon socket's (see tensors.encode).
        self._group_of = self.address[len("ipc://"):] if self.address.startswith("ipc://") else None
        # A tcp:// daemon may be on another machine, or see another /dev/shm: no file of ours reaches it, so a
        # request's tensors travel in the message, as many bytes as a message may hold.
        self._inline_up_to = settings.max_message_bytes() if self.address.startswith("tcp://") else None
        self.timeout_s = settings.request_timeout_s
        self._add_timeout_s = settings.add_timeout_s
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()     # one reconnect at a time (calls do not take it)
        self._lane: Channel | None = None   # serve requests, when the daemon has a lane
        self._lease_lane: Channel | None = None   # GPU opens, on the lane: their replies may bring descriptors
        self._closed = False
        self._broken = False              # the heartbeat saw the daemon go away: reconnect before the next call
        self._want_lane = lane            # False: infer goes over ZeroMQ too
        self._name = name or Path(os.sys.argv[0] or "python").name
        self._leases = LeaseKeeper()      # re-opened on a reconnect; a close names the id of now
        self._buffers = InputBuffers()    # serve calls' large inputs, over the lane (client/input_buffers.py)
        self._hello: P.HelloReply | None = None
        self.client_id = ""
        self._zmq = Channel(self.address, lambda: ZmqConnection(self._ctx, self.address), self.timeout_s,
                            on_connect=self._say_hello)
        self._zmq.connect()
        hello = self._hello
        self.daemon_version = hello.daemon_version
        self._heartbeat_stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._start_heartbeat()
        _live.add(self)

    def _start_heartbeat(self) -> None:
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(self._hello.heartbeat_interval_s,),
                                           name="modelcache-heartbeat", daemon=True)
        self._heartbeat.start()

    def _after_fork(self) -> None:
        """In a forked child (gunicorn's preload, multiprocessing): the ZeroMQ context, its sockets and the lane
        connections are the parent's, and a call here on them hung both processes (a ZeroMQ socket is not to be
        used in two processes; a lane connection's replies went to whichever read first). This process gets its
        own at its first call: a context, connections, a hello (a client of its own, holding no lease: the parent's
        stay the parent's) and a heartbeat. The parent's objects are kept, never used, closed or finalized here
        (a ZeroMQ context destroyed in the child waits on the parent's threads)."""
        _inherited.append((self._ctx, self._zmq, self._lane, self._lease_lane))
        self._ctx = zmq.Context.instance()   # (a new one in a child: pyzmq checks the pid)
        self._lock = threading.Lock()
        self._lane = self._lease_lane = None
        self._leases = LeaseKeeper()
        self._hello, self.client_id, self._broken = None, "", False
        self._zmq = Channel(self.address, lambda: ZmqConnection(self._ctx, self.address), self.timeout_s,
                            on_connect=self._say_hello)
        self._heartbeat_stop = threading.Event()
        self._heartbeat = None            # started with this process's first call (_call)

    # -- transport ---------------------------------------------------------------------
    @property
    def uses_lane(self) -> bool:
        """Whether serve-mode calls go over the serve lane (else ZeroMQ; see modelcache/wire/lane.py)."""
        return self._lane is not None

    def _say_hello(self, conn) -> None:
        """On each new ZeroMQ connection, before any other call uses it: hello, and after the first, the
        held leases again. DaemonUnavailable when a restarted daemon is not back (yet)."""
        first = self._hello is None
        timeout_s = self.timeout_s if first else min(self.timeout_s, HELLO_TIMEOUT_S)
        msg = P.Hello(req_id=0, protocol_version=P.PROTOCOL_VERSION, pid=os.getpid(), client_name=self._name)
        try:
            reply = self._zmq.exchange(msg, (P.HelloReply,), timeout_s, conn=conn)
        except RequestTimeout:
            if first:
                raise RequestTimeout(f"the modelcache daemon at {self.address} did not answer hello within "
                                     f"{timeout_s:g} s") from None
            raise DaemonUnavailable(f"the modelcache daemon at {self.address} is not back yet") from None
        if isinstance(reply, P.ErrorReply):
            raise from_code(reply.code, reply.message)
        self.client_id = reply.client_id
        self._hello = reply
        path = _lane.lane_path(self.address)
        if self._lane is None and self._want_lane and path is not None and os.path.exists(path):
            self._lane = Channel(self.address, lane_connection(path, self.address), self.timeout_s)
        if self._lane is not None:
            try:
                self._lane.connect()     # now, as the hello: the first serve request pays no connect
            except DaemonUnavailable:
                pass                     # it tries again with that request
        if first:
            return
        def reopen(name, version, device):
            msg = P.Open(req_id=0, client_id=self.client_id, name=name, version=version, device=device)
            gpu = self._gpu_channel() if device != "cpu" else None
            try:
                return gpu.exchange(msg, (P.OpenReply,)) if gpu is not None else \
                    self._zmq.exchange(msg, (P.OpenReply,), conn=conn)
            except ModelCacheError as e:
                return P.ErrorReply(req_id=0, code=e.code, message=str(e))

        relet, failed = self._leases.reopen(reopen)
        for why in failed:   # the session keeps running on its mapping; only the daemon's accounting misses it
            log.warning("modelcache: could not re-open %s after the daemon restarted", why)
        log.info("modelcache: reconnected to %s as %s, %d leases re-opened", self.address, self.client_id, relet)

    def _reconnect(self, forgotten: bool = False, blocking: bool = True) -> None:
        """A connection that works: a new one (hello, leases) if there is none, or the current one's own
        monitor saw the daemon go, or (forgotten) the daemon does not know our client id. Never a new hello
        on a connection that works: each makes a new client, whose leases would linger until they expire.
        DaemonUnavailable while the daemon is away."""
        if not self._lock.acquire(blocking):
            return
        try:
            conn = self._zmq._conn
            if conn is not None and (forgotten or conn.peer_gone()):
                self._zmq.drop()
            self._zmq.connect()
            self._broken = False
        finally:
            self._lock.release()

    def _gpu_channel(self) -> Channel | None:
        """The lane connection GPU opens go on (None: the daemon has none, a tcp:// one): under read-only
        sharing their replies bring the allocations as descriptors, which ZeroMQ cannot carry. A connection
        of its own, read with recvmsg, so that serve requests on the other keep the cheaper read."""
        path = _lane.lane_path(self.address)
        if self._lease_lane is None and path is not None and os.path.exists(path):
            self._lease_lane = Channel(self.address, lane_connection(path, self.address, with_fds=True),
                                       self.timeout_s)
        return self._lease_lane

    def _call(self, msg, expect: tuple, timeout_s: float | None = None, use_lane: bool = False, channel=None,
              fds=()):
        """Send one request and wait for its reply (or a typed error); serve requests over the lane (fds: passed
        with it there)."""
        if self._closed:
            raise DaemonUnavailable("this modelcache connection is closed")
        if self._heartbeat is None:   # the first call of a forked child (_after_fork)
            with self._lock:
                if self._heartbeat is None:
                    self._zmq.connect()
                    self._start_heartbeat()
        if self._broken:
            self._reconnect()
        channel = channel or (self._lane if use_lane and self._lane is not None else self._zmq)
        for retry in (False, True):
            sent_as = self.client_id
            reply = channel.exchange(msg, expect, timeout_s, retry_safe=isinstance(msg, RETRY_SAFE),
                                     prepare=self._address_to_current, fds=fds)
            if retry or not _daemon_forgot_us(reply):
                break
            # It restarted between our calls (nothing of ours was done): hello again, once, then the call.
            if self.client_id == sent_as:
                self._reconnect(forgotten=True)
        if isinstance(reply, P.ErrorReply):
            raise from_code(reply.code, reply.message)
        return reply

    def _address_to_current(self, msg) -> None:
        """Point a request at this connection: our client id now, the lease's id now."""
        if hasattr(msg, "client_id") and not isinstance(msg, P.Heartbeat):
            msg.client_id = self.client_id
        self._leases.address_close(msg)

    def _heartbeat_loop(self, interval_s: float) -> None:
        """Beat, and notice the daemon going away: then reconnect, with backoff, until it is back."""
        from zmq.utils.monitor import recv_monitor_message
        sock = self._ctx.socket(zmq.DEALER)  # sockets are not thread-safe: the heartbeat has its own
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)   # (ZeroMQ itself reconnects this one when the daemon is back)
        backoff_s = RECONNECT_BACKOFF_S[0]
        try:
            while not self._heartbeat_stop.wait(backoff_s if self._broken else interval_s):
                while monitor.poll(0):
                    if recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED:
                        self._broken = True
                if self._broken:
                    try:
                        if not self._closed:   # never wait on a caller: one in a call reconnects by itself
                            self._reconnect(blocking=False)
                    except ModelCacheError:
                        pass
                    backoff_s = RECONNECT_BACKOFF_S[0] if not self._broken else \
                        min(backoff_s * 2, RECONNECT_BACKOFF_S[1])
                    if self._broken:
                        continue
                try:
                    sock.send_multipart(P.encode(P.Heartbeat(client_id=self.client_id)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # daemon away; requests will say so
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    # -- API ---------------------------------------------------------------------------
    def open(self, name: str, version: int | None = None, device: str = "cpu") -> OpenedModel:
        """Lease a model: device "cpu" (the host tier) or "cuda" / "cuda:<UUID>" (a GPU copy, by IPC handle or, under
        read-only sharing, by descriptors: `received_fds` of the reply, the caller's to close)."""
        lease = self._call(P.Open(req_id=0, client_id=self.client_id, name=name, version=version, device=device,
                                  deadline_ms=answer_within_ms(self.timeout_s)), expect=(P.OpenReply,),
                           channel=self._gpu_channel() if device != "cpu" else None)
        self._leases.opened(lease, device)
        return lease

    def release(self, lease_id: str) -> None:
        self._leases.release(lease_id, lambda: self._call(P.Close(req_id=0, client_id=self.client_id,
                                                                  lease_id=lease_id), expect=(P.Ack,)))

    def load(self, name: str, version: int | None = None, tier: str = "host",
             timeout_s: float | None = None) -> P.ModelOutcome | None:
        """Prefetch a model into a tier: "host", "gpu" or "gpu:<UUID or index>" (fetching it from the remote store
        and promoting it through the host tier as need be); returns once resident, with what was done."""
        return _outcome(self._call(P.Load(req_id=0, name=name, version=version, tier=tier, outcome=True),
                                   expect=(P.ModelOutcome, P.Ack), timeout_s=timeout_s or self._add_timeout_s))

    def pin(self, name: str, version: int | None = None, pinned: bool = True) -> P.ModelOutcome | None:
        """The eviction policy never chooses a pinned model to make room (an explicit evict still frees it);
        unpin with pinned=False. Returns what was done."""
        return _outcome(self._call(P.Pin(req_id=0, name=name, version=version, pinned=pinned, outcome=True),
                                   expect=(P.ModelOutcome, P.Ack)))

    def remove(self, name: str, version: int) -> None:
        """Delete a model version from the repository; refused while it is in use."""
        self._call(P.Remove(req_id=0, name=name, version=version), expect=(P.Ack,))

    def configure(self, name: str, version: int, declared: dict) -> None:
        """Replace what a stored version declares beside its file ({serving, model_config, labels}: what `add`
        takes as `declared`), its weights unchanged: a Triton repository load whose config alone changed."""
        self._call(P.Configure(req_id=0, name=name, version=version, **declared), expect=(P.Ack,))

    def set_unloaded(self, name: str, unloaded: bool = True) -> None:
        """Triton's unload (True) or load (False) of a model or an ensemble, as the protocol fronts say it: not
        ready, its requests refused there, until loaded again; nothing removed (P.SetUnloaded)."""
        self._call(P.SetUnloaded(req_id=0, name=name, unloaded=unloaded), expect=(P.Ack,))

    def add_ensemble(self, name: str, version: int, config: dict) -> None:
        """Add a Triton ensemble (its configuration as Triton's JSON) whose steps are models the daemon has."""
        self._call(P.AddEnsemble(req_id=0, name=name, version=version, config=config), expect=(P.Ack,))

    def describe(self, name: str, version: int | None = None) -> P.DescribeReply:
        """A model's inputs, outputs and stages (no weights are touched)."""
        return self._call(P.Describe(req_id=0, name=name, version=version), expect=(P.DescribeReply,))

    def partition(self, name: str, stages: int | None = None, tail_fraction: float | None = None,
                  version: int | None = None, plan: dict | None = None) -> list[dict]:
        """Split a model into stages for serve mode (stages=1 undoes it), or as a placement plan says;
        returns the stages."""
        return self._call(P.Partition(req_id=0, name=name, version=version, stages=stages,
                                      tail_fraction=tail_fraction, plan=plan), expect=(P.DescribeReply,),
                          timeout_s=self._add_timeout_s).stages

    def infer(self, name: str, feeds: dict, output_names: list | None = None, version: int | None = None,
              deadline_ms: float | None = None, priority: int | None = None) -> tuple[dict, dict]:
        """Serve mode: the daemon runs the model. Returns (name -> output array, timings). `priority`: the request's
        priority level, in a model with priority levels (1 first; None: its default level)."""
        lane = self._lane   # (the one this call goes by: memory files only where it passes their descriptors)
        return infer_call(lambda wire, fds, lent_fds: self._call(
            P.Infer(req_id=0, client_id=self.client_id, name=name, inputs=wire, version=version,
                    output_names=output_names, deadline_ms=deadline_ms, priority=priority, ipc_fds=len(fds),
                    lent_fds=lent_fds),
            expect=(P.InferReply,), channel=lane or self._zmq, fds=fds), feeds, self._group_of, name,
            self._buffers if lane is not None else None, self._inline_up_to)

    def profile(self, name: str, feeds: dict, worker: str | None = None, runs: int = 3, min_s: float = 1.0,
                version: int | None = None) -> P.ProfileReply:
        """ORT's profiler over the model on one of the daemon's CPU workers (None: the first), where serve mode
        runs its stages: reply.times (node -> seconds per run, the warm-up first) and reply.args (shapes,
        sizes; reply.wake_s: the cold runs' extra seconds). The worker runs nothing else for the profile's span:
        at least `runs` back-to-back runs, a cold run (30 ms idle first) between each two, more until `min_s`;
        no run starts after MAX_PROFILE_S (60 s)."""
        from ..wire import tensors
        from ..wire.protocol import MAX_PROFILE_S
        wire, files = tensors.encode(feeds, group_of=self._group_of, model=name, inline_up_to=self._inline_up_to)
        try:
            # Beyond the usual timeout: the worker starts no run after MAX_PROFILE_S, but first finishes the
            # stages queued on it and builds the session.
            return self._call(P.Profile(req_id=0, name=name, inputs=wire, version=version, worker=worker, runs=runs,
                                        min_s=min_s), expect=(P.ProfileReply,),
                              timeout_s=self.timeout_s + MAX_PROFILE_S)
        finally:
            for f in files:
                os.unlink(f)

    def set_batching(self, name: str, profile: dict, version: int | None = None) -> None:
        """Store a batching calibration with the model (see modelcache.client.calibrate)."""
        self._call(P.SetBatching(req_id=0, name=name, version=version, profile=profile), expect=(P.Ack,))

    def evict(self, name: str, version: int | None = None, tier: str = "host") -> P.ModelOutcome | None:
        """Free the model's memory now; it stays on disk. tier="gpu" (or "gpu:<UUID or index>") demotes it
        from the GPU(s) only. Refused (CapacityError) while in use there. Returns what was done (the version,
        the tiers holding it before and after), or None from a daemon older than that reply."""
        return _outcome(self._call(P.Evict(req_id=0, name=name, version=version, tier=tier, outcome=True),
                                   expect=(P.ModelOutcome, P.Ack)))

    def verify(self, name: str | None = None) -> P.VerifyReply:
        """The daemon scrubs its repository (every version of `name`, or all) against the checksums of add
        time; a version marked corrupt whose files are intact again is served again (report["cleared"])."""
        return self._call(P.Verify(req_id=0, name=name), expect=(P.VerifyReply,), timeout_s=self._add_timeout_s)

    def list(self) -> list[dict]:
        return self.listing().models

    def listing(self) -> P.ModelList:
        """The daemon's models, and the remote store it fetches others from on first open (`remote`)."""
        return self._call(P.ListModels(req_id=0), expect=(P.ModelList,))

    def stats(self) -> P.StatsReply:
        return self._call(P.Stats(req_id=0), expect=(P.StatsReply,))

    def add(self, path: str, name: str, version: int | None = None, opt_level: str | None = None,
            timeout_s: float | None = None, prepack: bool | None = None, declared: dict | None = None,
            replace: bool = False) -> P.AddReply:
        """Pack an .onnx file into the daemon's repository (prepack: store shared MLAS-packed MatMul weights;
        None: the daemon's `prepack` setting). This process opens the file and each external-data
        file it references, with its own rights (an OSError is its own), and passes the descriptors over a
        lane connection of their own: the daemon never opens a path a client names (see modelcache/store/sources.py).
        `declared`: {"serving", "model_config", "labels"} a Triton configuration gives the model (triton_repo/).
        `replace`: `version` is there and this replaces it, swapped in once packed (daemon/swaps.py)."""
        from ..store.sources import close_all, open_model_files
        names, fds = open_model_files(path)
        lane = None
        try:
            lane = _lane.connect(self.address)
            if lane is None and _lane.lane_path(self.address) is None:
                raise DaemonUnavailable(f"add needs the daemon's local lane socket: a tcp:// daemon ({self.address}) "
                                        "cannot take files; copy the model to its host and add it there")
            if lane is None:   # (an ipc:// daemon whose lane is gone: it is stopping, or it died)
                raise DaemonUnavailable(f"the modelcache daemon at {self.address} takes no connection on its lane "
                                        f"({_lane.lane_path(self.address)}): it is stopping, or it is gone")
            # A connection of its own: the daemon takes descriptors only with a connection's first message.
            once = Channel(self.address, lambda: lane, self.timeout_s)
            reply = once.exchange(P.Add(req_id=0, path=os.path.abspath(path), name=name, version=version,
                                        opt_level=opt_level, files=names, prepack=prepack, replace=replace,
                                        **(declared or {})), (P.AddReply,),
                                  timeout_s=timeout_s or self._add_timeout_s, fds=fds)
            if isinstance(reply, P.ErrorReply):
                raise from_code(reply.code, reply.message)
            return reply
        finally:
            close_all(fds)
            if lane is not None:
                lane.close()

    def close(self) -> None:
        """Leave: the daemon releases this client's leases at once."""
        if self._closed:
            return
        self._heartbeat_stop.set()
        if self._heartbeat is not None:   # (else a forked child's copy that never called: no client to leave)
            try:
                self._call(P.Goodbye(req_id=0, client_id=self.client_id), expect=(P.Ack,), timeout_s=2.0)
            except Exception:
                pass  # the daemon will expire our leases anyway
        self._closed = True
        for channel in (self._lane, self._lease_lane):
            if channel is not None:
                channel.close()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=2)
        self._zmq.close()
        self._buffers.close()
        _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _outcome(reply) -> P.ModelOutcome | None:
    """What a load, pin or evict did, or None from a daemon older than ModelOutcome (it answers Ack)."""
    return reply if isinstance(reply, P.ModelOutcome) else None


def _daemon_forgot_us(reply) -> bool:
    """A daemon that restarted between our calls answers "unknown client" and did nothing else."""
    return isinstance(reply, P.ErrorReply) and reply.code == "lease" and reply.message.startswith("unknown client")


def connect(socket: str | None = None, timeout_s: float | None = None, name: str = "", lane: bool = True) -> Client:
    """Connect to the daemon at `socket` (default: settings, i.e. MODELCACHE_SOCKET).
    lane=False sends every call over ZeroMQ, serve mode too (the lane is faster; this is for comparing)."""
    return Client(socket, timeout_s, name, lane)


_shared: Client | None = None
_shared_lock = threading.Lock()
_live: "weakref.WeakSet[Client]" = weakref.WeakSet()   # open clients, for the fork hook
_inherited: list = []   # a forked child's: its parent's contexts, sockets and connections, kept unfinalized


def _in_forked_child() -> None:
    global _shared_lock
    _shared_lock = threading.Lock()   # (another thread may have held it at the fork)
    for client in list(_live):
        if not client._closed:
            client._after_fork()


os.register_at_fork(after_in_child=_in_forked_child)


def shared_client(socket: str | None = None) -> Client:
    """One connection per process (and per address) for the drop-in sessions, so they share one heartbeat."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared._closed or (socket and _shared.address != socket):
            _shared = Client(socket)
            atexit.register(_leave_at_exit, _shared, os.getpid())
        return _shared


def _leave_at_exit(client: Client, pid: int) -> None:
    """A process that exits with its drop-in sessions closed says goodbye: the daemon counts it as gone, not
    lost (`clients_lost` is for processes that died or fell silent). Not from a forked child, nor to a daemon
    the heartbeat already saw go (a goodbye would wait for it)."""
    if os.getpid() == pid and not client._closed and not client._broken:
        client.close()
