"""The resident daemon: one owner loop holds every table; loader threads only copy and pack.

This file holds the lifecycle, the message dispatch, sessions (hello, open, close), stats
and client liveness; the cache operations are in cache.py and serve mode in serving.py.

The owner loop (the main thread) polls the ROUTER socket that clients talk to and a
wake-up socket that loader threads poke when they finish. Loader threads never touch
the registry: they return results, and the owner applies them. Signal handlers only
set flags.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import signal
import time
import traceback
from pathlib import Path

import psutil
import zmq

from .. import __version__, protocol as P, tensors
from ..config import ConfigError, Settings
from ..executor.engine import Engine
from ..eviction import make_policy
from ..errors import CapacityError, LeaseError, ModelCacheError, ProtocolError
from ..tiers.disk import Repository
from ..tiers.host import HostTier
from ..tiers.remote import RemoteStore
from ..lane import lane_path
from .cache import CacheOps
from .devices import DeviceOps
from .fds import FdBudget, raise_fd_limit
from .identity import Admins, Peer, check_client_owner, credentials_from_peer_address
from .lane import LaneConnection, LaneServer, check_socket_file
from ..histogram import Histogram
from .metrics import MetricsServer, render
from .notify import Notifier
from .registry import ModelRecord, ModelState, Registry, describe_unreadable
from .restart import SocketLock, adopt_resident_models, settle_adopted
from .serving import ServeHandlers, serve_gpu_devices

log = logging.getLogger("modelcache.daemon")
WAKE_ADDR = "inproc://modelcache-wake"
PID_MAX = 1 << 22          # Linux's PID_MAX_LIMIT: no pid_max setting goes higher
MAX_CLIENT_NAME = 256      # a program's name, shown in stats
# Plain ints, not pyzmq's enums: enum arithmetic cost ~4 us per use, several times per request.
_EVENTS, _POLLIN, _SEND_MORE, _SEND_LAST = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SNDMORE | zmq.NOBLOCK), \
    int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


class Daemon(CacheOps, DeviceOps, ServeHandlers):
    # Settings a reload (SIGHUP / systemctl reload) applies live; the others need a restart.
    LIVE_SETTINGS = ("log_level", "heartbeat_interval_s", "lease_timeout_s", "host_capacity",
                     "batching", "max_batch", "t_opt_ms", "batch_window_ms", "max_queue_delay_ms",
                     "inline_run_ms")

    def __init__(self, settings: Settings, clock=time.monotonic, wall=time.time, reload_settings=None):
        self.settings = settings
        self.reload_settings = reload_settings  # () -> Settings, re-read from file and environment
        self.clock = clock
        self.wall = wall
        self.registry = Registry()
        self.repository = Repository(settings.repository_path)
        self.host = HostTier(settings.shm_dir, settings.host_capacity_bytes(), owner=settings.socket,
                             verify=settings.verify_promotion)
        self.devices: dict = {}                 # GPU tier: device UUID -> tiers.gpu.DeviceTier (see devices.py)
        self.device_policies: dict = {}         # device UUID -> its eviction policy
        self.remote = RemoteStore(settings.remote, settings.request_timeout_s) if settings.remote else None
        self.fetches: dict = {}                 # (name, version) -> [(retry, fail)] waiting on one fetch
        try:
            self.policy = make_policy(settings.eviction_policy)
            self.admins = Admins(settings.admin_group)
            self.engine = Engine(settings, Path(settings.state_dir) / "perfmodels.json", self._post, clock,
                                 gpu_devices=serve_gpu_devices(settings), device_lease=self._serve_device_lease)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.loaders = concurrent.futures.ThreadPoolExecutor(settings.loader_threads, thread_name_prefix="loader")
        self.completions: queue.Queue = queue.Queue()
        self._thread_sockets = threading.local()
        self.serve_specs: dict = {}             # model key -> (segments, stage specs), see _serve_specs
        self.serve_device_specs: dict = {}      # (model key, device UUID) -> its GPU stage specs, see serving.py
        self.jobs: dict[str, dict] = {}          # in-flight packs and loads, for stats
        self.reserved_versions: set = set()     # versions being packed, not yet in the registry
        self.counters = {"opens": 0, "hits": 0, "misses": 0, "closes": 0, "adds": 0,
                         "clients_lost": 0, "bad_messages": 0, "promotions": 0, "evictions": 0,
                         "gpu_promotions": 0, "gpu_evictions": 0, "adopted": 0, "corrupt_detected": 0,
                         "refetched": 0, "fetched": 0}
        self.started = wall()
        # When the owner loop last came back from not listening (see serve_forever): silence before it is not counted.
        self.listening_since = float("-inf")
        self.turn_at = float("inf")             # when the owner loop's poll last returned (see sweep_clients)
        self.stop_requested = False
        self.reload_requested = False
        self.pending: list = []                 # (future, done) of loader tasks, to answer them at stop
        # Packing subprocesses, so an immediate stop can kill them. Loader threads add and remove
        # entries (single set operations, atomic under the GIL); only the signal handler reads it.
        self.packers: set = set()
        self.open_latency = Histogram()
        self.notifier = Notifier()
        self.metrics: MetricsServer | None = None
        self.http_front = None                  # daemon/http_front.py, when http_port is set
        self.ctx = zmq.Context.instance()
        # Only an ipc:// peer has kernel credentials; a tcp:// one's Peer-Address is an IP (see identity.py).
        self.peers_have_credentials = settings.socket.startswith("ipc://")
        self.router = None
        self.wake_rx = None
        self.socket_lock: SocketLock | None = None
        self.fd_budget: FdBudget | None = None
        self.router_events = None               # the ROUTER's accepted connections, to watch descriptors
        self.router_bound = False               # False while descriptors are short (see _check_fds)
        path = lane_path(settings.socket)
        # serve-mode calls, see modelcache/lane.py
        self.lane = LaneServer(path, self.counters, settings.max_message_bytes()) if path else None
        if self.lane is not None:
            self.lane.on_close = self._connection_closed

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Scan the repository, create the host tier, bind the socket. After this, clients may connect."""
        addr = self.settings.socket
        self.fd_budget = FdBudget(raise_fd_limit())   # before any socket: see daemon/fds.py
        if addr.startswith("ipc://"):  # first: a daemon that refuses to start leaves nothing behind
            path = Path(addr[len("ipc://"):])
            path.parent.mkdir(parents=True, exist_ok=True)
            self.socket_lock = SocketLock(path)
            self.socket_lock.acquire()
            if os.path.lexists(path):
                check_socket_file(path)
                self._refuse_if_live(addr)
                path.unlink()
            if self.lane is not None:
                check_socket_file(Path(self.lane.path))
        for model_dir, manifest in self.repository.scan():
            self.registry.add_model(model_dir, manifest)
        adoption = adopt_resident_models(self)   # warm restart: a dead daemon's host tier, checked
        self.host.start()
        self._start_devices()
        settle_adopted(self, adoption)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to vanished clients are dropped, not raised
        # A longer frame disconnects its sender before libzmq allocates it (big tensors go through shm files).
        self.router.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes())
        self.router_events = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self._bind_router()
        self.wake_rx = self.ctx.socket(zmq.PULL)
        self.wake_rx.bind(WAKE_ADDR)
        self.engine.start()
        if self.settings.metrics_port:
            self.metrics = MetricsServer(self.settings.metrics_host, self.settings.metrics_port)
            self.metrics.start()
            self.publish_metrics()
            log.info("metrics on http://%s:%d/metrics", self.settings.metrics_host, self.metrics.port)
        if self.settings.http_port:
            from .http_front import HttpFront
            self.http_front = HttpFront(self.settings.socket, self.settings.http_host, self.settings.http_port)
        log.info("modelcache %s ready on %s: %d models in %s, host tier %s (%d MiB)", __version__, addr,
                 len(self.registry.models), self.repository.root, self.host.root,
                 self.host.capacity_bytes >> 20)

    def _bind_router(self) -> None:
        addr = self.settings.socket
        if addr.startswith("ipc://"):   # ours (we hold its lock): libzmq's unbind leaves the file behind
            Path(addr[len("ipc://"):]).unlink(missing_ok=True)
        self.router.bind(addr)
        self.router_bound = True
        if addr.startswith("ipc://"):
            os.chmod(addr[len("ipc://"):], 0o660)  # the daemon's group may connect; others may not

    def _check_fds(self) -> None:
        """Stop listening on both sockets while descriptors are short; listen again when they are not."""
        paused = self.fd_budget.check()
        if self.lane is not None:
            self.lane.set_accepting(not paused)
        if paused and self.router_bound:
            self.router.unbind(self.settings.socket)   # libzmq would accept into EMFILE and abort
            self.router_bound = False
        elif not paused and not self.router_bound:
            self._bind_router()

    def _refuse_if_live(self, addr: str) -> None:
        """A socket file exists: refuse to start if a daemon still answers there, else it is stale."""
        probe = self.ctx.socket(zmq.DEALER)
        probe.setsockopt(zmq.LINGER, 0)
        try:
            probe.connect(addr)
            probe.send_multipart(P.encode(P.Stats(req_id=1)))
            if probe.poll(500):
                raise ModelCacheError(f"another modelcache daemon is already serving {addr}")
        finally:
            probe.close()

    def request_stop(self, *_):
        """Signal handler: the first signal asks for a graceful stop, a second one exits at once."""
        if self.stop_requested:
            for proc in list(self.packers):
                if proc.poll() is None:
                    proc.kill()
            self._remove_socket_file()
            self.host.stop(keep=self.settings.keep_host_tier)  # (device memory goes with the process)
            os._exit(1)
        self.stop_requested = True

    def request_reload(self, *_):
        self.reload_requested = True

    def reload(self) -> None:
        """Re-read settings and apply the ones that can change live."""
        self.notifier.reloading()
        try:
            new = self.reload_settings() if self.reload_settings else self.settings
            changed = []
            for name in self.LIVE_SETTINGS:
                if getattr(new, name) != getattr(self.settings, name):
                    setattr(self.settings, name, getattr(new, name))
                    changed.append(f"{name}={getattr(new, name)}")
            logging.getLogger("modelcache").setLevel(self.settings.log_level.upper())
            self.host.capacity_bytes = self.settings.host_capacity_bytes()
            self.engine.settings_changed()
            log.info("reloaded settings: %s", ", ".join(changed) or "nothing changed")
        except ModelCacheError as e:
            log.error("reload failed, keeping the old settings: %s", e)
        self.notifier.ready(self.status_line())

    def status_line(self) -> str:
        resident = sum(1 for m in self.registry.models.values() if m.state is ModelState.RESIDENT)
        gpus = "".join(f", GPU {t.device.index} {t.used_bytes >> 20}/{t.capacity_bytes >> 20} MiB"
                       for t in self.devices.values())
        return (f"{len(self.registry.models)} models ({resident} resident), {len(self.registry.clients)} clients, "
                f"host {self.host.used_bytes >> 20}/{self.host.capacity_bytes >> 20} MiB{gpus}")

    def publish_metrics(self) -> None:
        if self.metrics is None:
            return
        tiers = self._describe_tiers()
        self.metrics.publish(render(self.counters, tiers, self._describe_models(), len(self.registry.clients),
                                    self.wall() - self.started, self.open_latency, [s.value for s in ModelState],
                                    self.engine.describe(), self.engine.latency_by_model))

    def serve_forever(self, on_ready=None) -> None:
        self.start()
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake_rx, zmq.POLLIN)
        poller.register(self.router_events, zmq.POLLIN)
        if self.lane is not None:
            self.lane.start(poller)
            self.lane.budget = self.fd_budget
        self.notifier.ready(self.status_line())
        if self.http_front is not None:   # once the lane listens: its first request may come at once
            self.http_front.start()
        if on_ready:
            on_ready()
        next_sweep = self.clock()
        next_watchdog = self.clock()
        last_turn_at = self.clock()
        try:
            while not self.stop_requested:
                if self.reload_requested:
                    self.reload_requested = False
                    self.reload()
                if self.notifier.watchdog_interval_s and self.clock() >= next_watchdog:
                    self.notifier.watchdog()  # only while the owner loop turns: a stuck loop gets restarted
                    next_watchdog = self.clock() + self.notifier.watchdog_interval_s
                wake_at = min(next_sweep, self.engine.next_wakeup() or next_sweep)  # a batching window ends
                timeout_ms = max(0, int((wake_at - self.clock()) * 1000 + 0.999))
                events = dict(poller.poll(min(timeout_ms, 250)))
                turn_at = self.turn_at = self.clock()
                if turn_at - last_turn_at > self.settings.lease_timeout_s / 2:
                    # The loop was not listening (a long handler; the process stopped, swapped or starved):
                    # heartbeats sent meanwhile may still be on their way in through libzmq's I/O thread, and
                    # the sweep must not drop live clients for them (a 3 s SIGSTOP dropped every client).
                    self.listening_since = turn_at
                last_turn_at = turn_at
                if self.router_events in events:
                    while self.router_events.poll(0):
                        self.router_events.recv_multipart()
                    self._check_fds()
                if self.wake_rx in events:
                    while self.wake_rx.poll(0):
                        self.wake_rx.recv()
                    self._apply_completions()
                if self.router in events:
                    # A bounded batch, so completions and sweeps are not starved. Ask EVENTS rather
                    # than recv until zmq.Again: raising Again cost ~0.3 ms a request.
                    for _ in range(256):
                        if not self.router.getsockopt(_EVENTS) & _POLLIN:
                            break
                        self._handle(self._recv_request())
                for key, ready in events.items():
                    if type(key) is int:   # a raw file descriptor: the lane's
                        self.lane.on_ready(key, ready, self._handle)
                self.engine.on_timer(self.clock())
                if self.clock() >= next_sweep:
                    self._check_fds()
                    self.sweep_clients()
                    for key in self.engine.drop_idle(self.clock(), self.settings.serve_idle_s):
                        log.info("serve sessions of %s dropped after %.0f s idle", key, self.settings.serve_idle_s)
                    self.publish_metrics()
                    if self.http_front is not None:
                        self.http_front.check()
                    next_sweep = self.clock() + min(self.settings.heartbeat_interval_s,
                                                    self.notifier.watchdog_interval_s or 1e9)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        """Graceful stop: finish running loads and packs, answer everyone waiting, then remove our traces."""
        self.notifier.stopping()
        if self.http_front is not None:   # first: the drain below answers its requests in flight
            self.http_front.terminate()
        log.info("stopping: %d clients, %d leases, %d jobs in flight", len(self.registry.clients),
                 len(self.registry.leases), len(self.jobs))
        deadline = self.clock() + 60
        while self.engine.requests and self.clock() < deadline:  # in-flight inferences finish first
            if self.wake_rx.poll(10):
                while self.wake_rx.poll(0):
                    self.wake_rx.recv()
            self._apply_completions()
            self.engine.on_timer(self.clock())
        self.loaders.shutdown(wait=True, cancel_futures=True)
        self._apply_completions()
        self.engine.stop()
        stopping = ModelCacheError("the modelcache daemon is stopping")
        for future, done in self.pending:
            if future.cancelled():  # queued, never started: its caller still deserves an answer
                done(None, stopping)
        if self.lane is not None:
            self.lane.stop()
        if self.router_events is not None:
            self.router.disable_monitor()
            self.router_events.close(linger=0)
        if self.router is not None:
            self.router.close(linger=2000)  # let the last answers (drained above) reach their clients
        if self.wake_rx is not None:
            self.wake_rx.close(linger=0)
        if self.metrics is not None:
            self.metrics.stop()
        if self.http_front is not None:
            self.http_front.wait()
        self._remove_socket_file()
        # Clients that still map a model keep their pages (host and GPU): freeing only drops our references.
        self._stop_devices()
        self.host.stop(keep=self.settings.keep_host_tier)  # kept: the next daemon here re-adopts it
        self.notifier.close()

    def _remove_socket_file(self) -> None:
        addr = self.settings.socket
        if addr.startswith("ipc://"):
            Path(addr[len("ipc://"):]).unlink(missing_ok=True)
        if self.lane is not None:
            Path(self.lane.path).unlink(missing_ok=True)
        if self.socket_lock is not None:
            self.socket_lock.release()

    # -- message dispatch --------------------------------------------------------------
    def _recv_request(self) -> list:
        """A message's frames from the ROUTER: its sender (a Peer), kind, body. Frames past the fourth are
        read and dropped (the message then fails to decode as too many frames): MAXMSGSIZE bounds each
        frame, not how many a peer sends, and a list of a million of them is not ours to build.

        Only the routing id is received as a zmq.Frame, for its sender's credentials: a Frame and its
        Peer-Address cost +2.7 us a request against plain recv() (8.4-10.7 vs 11.4-13.8 us to drain a
        3-frame message from 20,000 queued on an ipc:// ROUTER, this VM), and the other frames need no Frame."""
        recv, more = self.router.recv, self.router.getsockopt
        first = recv(copy=False)
        creds = credentials_from_peer_address(first.get("Peer-Address")) if self.peers_have_credentials else None
        frames = [Peer(first.bytes, creds)]
        while more(_RCVMORE):
            frame = recv()
            if len(frames) < 4:
                frames.append(frame)
        return frames

    def _handle(self, frames: list[bytes]) -> None:
        ident, body = frames[0], frames[1:]
        try:
            msg = P.decode(body, max_items=P.REQUEST_MAX_ITEMS)
            handler = getattr(self, "on_" + type(msg).__name__, None)
            if handler is None:
                raise ProtocolError(f"{msg.KIND.decode()!r} is a reply, not a request")
        except ProtocolError as e:
            self.counters["bad_messages"] += 1
            log.warning("bad message from a client: %s", e)
            self._reply(ident, P.ErrorReply(req_id=P.req_id_of(body) if body else 0, code=e.code, message=str(e)))
            return
        self._dispatch(ident, msg, handler)

    def _dispatch(self, ident: bytes, msg, handler=None) -> None:
        """Run a request's handler and send its reply or its error; also used to re-run a request."""
        handler = handler or getattr(self, "on_" + type(msg).__name__)
        try:
            reply = handler(ident, msg)
        except ModelCacheError as e:
            reply = P.ErrorReply(req_id=msg.req_id, code=e.code, message=str(e))
        except Exception as e:  # a bug must cost one request, never the daemon
            log.error("internal error on %s: %s", msg.KIND.decode(), traceback.format_exc())
            reply = P.ErrorReply(req_id=getattr(msg, "req_id", 0), code="internal", message=f"internal error: {e}")
        if reply is not None:
            self._reply(ident, reply)

    def _reply(self, ident, msg) -> None:
        """Answer on the transport the request came by: a ZeroMQ routing id, or a lane connection."""
        kind, body = P.encode(msg)
        if type(ident) is LaneConnection:
            ident.send(kind, body)
            return
        try:
            send = self.router.send
            send(ident.routing_id, _SEND_MORE)
            send(kind, _SEND_MORE)
            send(body, _SEND_LAST)
        except zmq.ZMQError as e:  # the client is gone or its queue is full: its loss
            log.debug("reply dropped: %s", e)

    def _touch(self, client_id: str, ident, name: str = ""):
        """The caller's own client record, kept alive; PermissionDenied if the id is another process's.
        Client id "" on a lane connection is the connection's own client, made by its first open: an
        attach-mode client needs no hello and no heartbeat (client/leases.py)."""
        if not client_id and type(ident) is LaneConnection:
            if ident.sock is None:   # a request re-run (after a fetch) for a connection that has gone
                raise LeaseError("the connection that asked has closed")
            client = self.registry.clients.get(ident.client_id) if ident.client_id else None
            if client is None:
                client = self._new_client(ident, name, connection=ident)
                ident.client_id = client.client_id
            return client
        client = self.registry.client(client_id)
        check_client_owner(ident, client)
        client.last_seen = self.clock()
        return client

    def _new_client(self, ident, name: str, connection=None):
        if len(name) > MAX_CLIENT_NAME:
            raise ProtocolError(f"client_name is {len(name)} characters; at most {MAX_CLIENT_NAME}")
        if len(self.registry.clients) >= self.settings.max_clients:
            raise CapacityError(f"the modelcache daemon serves {len(self.registry.clients)} clients, its "
                                f"max_clients; try again later, or raise max_clients")
        # The kernel's pid, not the message's: the sweep drops a client whose process is gone. A tcp:// client
        # has none (0: the heartbeat alone decides).
        client = self.registry.new_client(ident.pid, name, self.clock(), ident.uid, ident.gid, connection)
        log.debug("client %s (pid %d, uid %s) connected%s", client.client_id, ident.pid, ident.uid,
                  " on the lane" if connection is not None else "")
        return client

    def _connection_closed(self, conn: LaneConnection) -> None:
        """A lane connection that was a client went away: that client left, with its leases."""
        client = self.registry.clients.get(conn.client_id) if conn.client_id else None
        if client is None or client.connection is not conn:
            return
        released = self.registry.drop_client(client.client_id)
        for lease in released:
            self._after_release(lease.model, lease.device)
        if released:   # left holding leases: it exited (or died) without closing its sessions
            self.counters["clients_lost"] += 1
            log.info("client gone: %s (pid %d), its connection closed holding %d leases; released them",
                     client.client_id, client.pid, len(released))

    # -- handlers: each returns a reply, or None when it will reply later ---------------
    def on_Hello(self, ident, msg: P.Hello):
        if msg.protocol_version != P.PROTOCOL_VERSION:
            raise ProtocolError(f"client speaks protocol {msg.protocol_version}, this daemon "
                                f"{P.PROTOCOL_VERSION}: upgrade the older of the two")
        # The sweep asks the kernel about this pid: one past what a pid can be (2**31) killed the daemon there.
        if not 0 <= msg.pid <= PID_MAX:
            raise ProtocolError(f"hello: pid {msg.pid} is not a process id (1 to {PID_MAX}, or 0 for none)")
        client = self._new_client(ident, msg.client_name)
        return P.HelloReply(req_id=msg.req_id, protocol_version=P.PROTOCOL_VERSION, daemon_version=__version__,
                            client_id=client.client_id, heartbeat_interval_s=self.settings.heartbeat_interval_s,
                            lease_timeout_s=self.settings.lease_timeout_s)

    def on_Heartbeat(self, ident, msg: P.Heartbeat):
        client = self.registry.clients.get(msg.client_id)
        if client is not None and (client.uid is None or (ident.uid, ident.pid) == (client.uid, client.pid)):
            client.last_seen = self.clock()   # (another process's heartbeat for it keeps nothing alive)
        return None

    def on_Goodbye(self, ident, msg: P.Goodbye):
        client = self.registry.clients.get(msg.client_id)
        if client is not None:
            check_client_owner(ident, client)
        for lease in self.registry.drop_client(msg.client_id):
            self._after_release(lease.model, lease.device)
        return P.Ack(req_id=msg.req_id)

    def on_Open(self, ident, msg: P.Open):
        client = self._touch(msg.client_id, ident, msg.client_name)
        tier = None if msg.device == "cpu" else self._device_tier(msg.device)
        model = self._resolve_or_fetch(ident, msg)
        if model is None:
            return None  # fetching from the remote store; the request runs again when it lands
        self.counters["opens"] += 1
        t_request = self.clock()

        def answer(error: ModelCacheError | None, hit: bool):
            self.open_latency.observe(self.clock() - t_request)
            if error is not None:
                self._reply(ident, P.ErrorReply(req_id=msg.req_id, code=error.code, message=str(error)))
                return
            if self.registry.clients.get(client.client_id) is not client:  # left while we were loading
                self._after_release(model)
                return
            uuid = tier.device.uuid if tier is not None else None
            lease = self.registry.grant(client, model, self.wall(), uuid)
            self.policy.accessed(model.key, self.clock())
            if uuid is not None:
                self.device_policies[uuid].accessed(model.key, self.clock())
            self._reply(ident, self._open_reply(msg.req_id, lease.lease_id, model, hit, tier))

        hit = self._when_resident(model, answer) if tier is None else self._when_on_device(model, tier, answer)
        model.hits += hit
        model.misses += not hit
        self.counters["hits" if hit else "misses"] += 1
        return None

    def _open_reply(self, req_id: int, lease_id: str, model: ModelRecord, hit: bool, tier=None) -> P.OpenReply:
        m = model.manifest
        io = m.io_summary()
        if tier is None:
            skeleton, segments, tensors = self.host.export(model.key, m)
            where = {"skeleton_path": skeleton, "segments": segments, "tensors": tensors,
                     "prepacked": sorted(self.host.prepacked_tensors(model.key))}
        else:
            where = self._device_open_fields(model, tier)
        return P.OpenReply(req_id=req_id, lease_id=lease_id, name=model.name, version=model.version,
                           inputs=io["inputs"], outputs=io["outputs"], weights_bytes=m.weights_bytes, hit=hit,
                           **where)

    def on_Close(self, ident, msg: P.Close):
        client = self._touch(msg.client_id, ident)
        lease = self.registry.release(msg.lease_id, client.client_id)
        self._after_release(lease.model, lease.device)
        self.counters["closes"] += 1
        return P.Ack(req_id=msg.req_id)

    def on_ListModels(self, ident, msg: P.ListModels):
        return P.ModelList(req_id=msg.req_id, models=self._describe_models())

    def _describe_models(self) -> list[dict]:
        return [m.describe() for _, m in sorted(self.registry.models.items())] + \
            [describe_unreadable(n, v, why) for (n, v), why in sorted(self.repository.unreadable.items())]

    def on_Stats(self, ident, msg: P.Stats):
        now = self.clock()
        admin = self.admins.is_admin(ident)
        clients = []
        for c in self.registry.clients.values():
            entry = {"client_id": c.client_id, "pid": c.pid, "name": c.name, "leases": len(c.leases),
                     "idle_s": round(now - c.last_seen, 2)}
            if not (admin or (c.uid is not None and c.uid == ident.uid)):
                # Others' client ids are what `bye` and lease calls name: only admins see them (and their programs).
                entry.update(client_id="", pid=0, name="(another user)")
            clients.append(entry)
        tiers = self._describe_tiers()
        return P.StatsReply(req_id=msg.req_id, daemon_version=__version__, pid=os.getpid(),
                            uptime_s=self.wall() - self.started, socket=self.settings.socket, clients=clients,
                            models=self._describe_models(), tiers=tiers, counters=dict(self.counters),
                            jobs=[dict(j) for j in self.jobs.values()],
                            executor={**self.engine.describe(),
                                      "lane_connections": len(self.lane.conns) if self.lane else None})

    def _describe_tiers(self) -> list[dict]:
        return [{"tier": "host", "path": str(self.host.root), "used_bytes": self.host.used_bytes,
                 "capacity_bytes": self.host.capacity_bytes},
                *self._describe_devices(),
                {"tier": "disk", "path": str(self.repository.root),
                 "used_bytes": sum(m.manifest.weights_bytes for m in self.registry.models.values()),
                 "capacity_bytes": 0}]

    def _post(self, done, result, error) -> None:
        """From any thread: have `done(result, error)` run on the owner loop, and wake it."""
        self.completions.put((done, result, error))
        wake = getattr(self._thread_sockets, "wake", None)
        if wake is None:  # one PUSH socket per posting thread: sockets are not thread-safe, and
            wake = self._thread_sockets.wake = self.ctx.socket(zmq.PUSH)  # one per post cost ~70 us
            wake.setsockopt(zmq.LINGER, 0)
            wake.connect(WAKE_ADDR)
        try:
            wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the owner is stopping, or already has a wake-up queued: either way it will look

    def _run_on_loader(self, work, done) -> None:
        """Run `work` on a loader thread; `done(result, error)` runs later on the owner loop."""
        def task():
            try:
                result, error = work(), None
            except ModelCacheError as e:
                result, error = None, e
            except Exception as e:
                log.error("loader task failed: %s", traceback.format_exc())
                result, error = None, ModelCacheError(f"{type(e).__name__}: {e}")
            self._post(done, result, error)
        self.pending = [(f, d) for f, d in self.pending if not f.done()]
        self.pending.append((self.loaders.submit(task), done))

    def _apply_completions(self) -> None:
        while True:
            try:
                done, result, error = self.completions.get_nowait()
            except queue.Empty:
                return
            try:
                done(result, error)
            except Exception:  # a bug in one completion must not take the daemon (and every client) down
                log.error("internal error in a completion: %s", traceback.format_exc())

    # -- client liveness ---------------------------------------------------------------
    def sweep_clients(self) -> None:
        """Release the leases of clients that stopped sending heartbeats or whose process died."""
        now = self.clock()
        if now - self.turn_at > self.settings.lease_timeout_s / 2:
            # Stopped after this turn's poll and before this reading: what arrived meanwhile is unread. Judged
            # on the same reading as the silence below: a check made a few calls earlier left a window (a
            # SIGSTOP landing in _check_fds dropped every live client in CI).
            self.listening_since = now
        for client in list(self.registry.clients.values()):
            try:
                # A lane connection's client sends no heartbeats: the connection's end is its end.
                silent = client.connection is None and \
                    now - max(client.last_seen, self.listening_since) > self.settings.lease_timeout_s
                dead = self._process_gone(client.pid)
                if silent or dead:
                    released = self.registry.drop_client(client.client_id)
                    for lease in released:
                        self._after_release(lease.model, lease.device)
                    self.counters["clients_lost"] += 1
                    files = tensors.remove_io_files_of(client.pid) if dead else 0
                    log.info("client lost: %s (pid %d, %s), released %d leases, removed %d I/O files", client.client_id,
                             client.pid, "process gone" if dead else "no heartbeat", len(released), files)
            except Exception:  # one client's record must not stop the sweep, or the owner loop with it
                log.error("sweep failed on client %s: %s", client.client_id, traceback.format_exc())

    @staticmethod
    def _process_gone(pid: int) -> bool:
        """Whether the client's process has surely exited; False when the kernel cannot say (then the
        heartbeat decides), e.g. with no file descriptor left to read /proc."""
        if pid <= 0:
            return False
        try:
            return not psutil.pid_exists(pid)
        except (OSError, OverflowError, ValueError) as e:
            log.warning("cannot tell whether pid %d is alive: %s", pid, e)
            return False


def run(settings: Settings, on_ready=None, reload_settings=None) -> None:
    daemon = Daemon(settings, reload_settings=reload_settings)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    signal.signal(signal.SIGHUP, daemon.request_reload)
    daemon.serve_forever(on_ready)
    log.info("stopped")
