"""The resident daemon: one owner loop holds every table; loader threads only copy and pack.

The daemon is composed of objects that each own one thing, each handed its collaborators:
`Loaders` (loader threads, loaders.py), one `Residency` per memory tier (what is resident there,
residency/: the host tier's, and each GPU's in `GpuTiers`, gpus.py), `Fetcher` (the remote store,
fetch.py), `Models` (load, evict, pin, remove, add, verify, models.py), `Serving` (serve mode over the
executor's engine, serving.py) and `Sessions` (clients, leases, liveness, sessions.py). This file
holds the owner loop, the sockets, start and stop, the dispatch table from message type to handler,
and stats.

The owner loop (the main thread) polls the ROUTER socket that clients talk to and a
wake-up socket that loader threads poke when they finish. Loader threads never touch
the registry: they return results, and the owner applies them. Signal handlers only
set flags.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import signal
import time
import traceback
from pathlib import Path

import zmq

from .. import __version__
from ..wire.lent_outputs import LentFiles
from ..wire import protocol as P
from ..wire import tensors
from ..config import ConfigError, Settings
from ..executor.engine import Engine
from ..executor.response_cache import ResponseCache
from ..errors import InputError, ModelCacheError, PermissionDenied, ProtocolError
from ..tiers.disk import Repository
from ..tiers.host import HostTier
from ..tiers.remote import RemoteStore
from ..wire.lane import lane_path
from ..memlimit import read_limit
from ..eviction import make_policy as named_policy
from ..storage import remove_tree, storage_errors
from .disk_opens import DiskOpens
from .fds import FdBudget, raise_fd_limit
from .fetch import Fetcher
from .gpus import GpuTiers
from ..address import bind_error
from .identity import Admins, Peer, credentials_from_peer_address
from .lane_server import LaneConnection, LaneServer, check_socket_file
from ..histogram import Histogram
from .loaders import Loaders
from .memory import MemoryGuard, PressureWatch, check_capacity
from .metrics import MetricsServer, render
from .log_settings import LogSettings
from .swaps import Swaps
from .triton_metrics import CpuUtilization, machine_memory, render_triton
from .models import Models
from .notify import Notifier
from .registry import Registry, describe_unreadable
from .residency import ModelState
from .wording import plural
from .residency import Residency
from .restart import SocketLock, adopt_resident_models, settle_adopted
from .ensembles import Ensembles, EnsembleStore
from .serving import Serving, serve_gpu_devices
from .sessions import Sessions

log = logging.getLogger("modelcache.daemon")
WAKE_ADDR = "inproc://modelcache-wake"
# Plain ints, not pyzmq's enums: enum arithmetic cost ~4 us per use, several times per request.
_EVENTS, _POLLIN, _SEND_MORE, _SEND_LAST = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.SNDMORE | zmq.NOBLOCK), \
    int(zmq.NOBLOCK)
_RCVMORE = int(zmq.RCVMORE)


def policy_for(settings, clock):
    """A tier's eviction policy on the tier's clock, as the settings name it: `eviction_policy`, and for the
    timed ones (keepalive, hybrid) `keep_alive_s`."""
    return named_policy(settings.eviction_policy, clock, keep_alive_s=settings.keep_alive_s)


class Daemon:
    # Settings a reload (SIGHUP / systemctl reload) applies live; the others need a restart.
    LIVE_SETTINGS = ("log_level", "heartbeat_interval_s", "lease_timeout_s", "host_capacity", "gpu_capacity",
                     "memory_reserve", "capacity_over_limit",
                     "batching", "max_batch", "t_opt_ms", "batch_window_ms", "max_queue_delay_ms",
                     "max_queue", "inline_run_ms", "response_cache_size")

    def __init__(self, settings: Settings, clock=time.monotonic, wall=time.time, reload_settings=None,
                 make_policy=policy_for):
        """`make_policy(settings, clock)`: each tier's eviction policy (a replay that compresses trace time
        passes one whose windows are compressed with it: benchmarks/faas/compressed_daemon.py)."""
        self.settings = settings
        self.reload_settings = reload_settings  # () -> Settings, re-read from file and environment
        self.clock = clock
        self.wall = wall
        self.registry = Registry()
        self.repository = Repository(settings.repository_path)
        # The memory limit (RAM, or the cgroup's) sizes the host tier and is watched (memory.py).
        limit = read_limit()
        self.host = HostTier(settings.shm_dir, self._host_capacity(settings, limit), owner=settings.socket,
                             verify=settings.verify_promotion, source=self.repository)
        self.remote = RemoteStore(settings.remote, settings.request_timeout_s) if settings.remote else None
        self._thread_sockets = threading.local()
        self.loaders = Loaders(settings.loader_threads, wake=self._wake)
        self.jobs: dict[str, dict] = {}          # in-flight packs, fetches and loads, for stats
        self.counters = {"opens": 0, "hits": 0, "misses": 0, "closes": 0, "adds": 0,
                         "clients_lost": 0, "bad_messages": 0, "promotions": 0, "evictions": 0,
                         "gpu_promotions": 0, "gpu_evictions": 0, "adopted": 0, "corrupt_detected": 0,
                         "refetched": 0, "fetched": 0, "unloads": 0, "prewarms": 0, "gpu_unloads": 0,
                         "gpu_prewarms": 0, "wasted_prewarms": 0, "gpu_wasted_prewarms": 0,
                         "pressure_evictions": 0, "pressure_reliefs": 0, "opens_from_disk": 0,
                         "outputs_lent": 0, "outputs_large_inline": 0}
        self.memory = MemoryGuard(limit, settings.memory_reserve_bytes(limit.limit_bytes), counters=self.counters)
        self.pressure_watch: PressureWatch | None = None
        self.open_latency = Histogram()
        try:
            policy = make_policy(settings, clock)
            self.admins = Admins(settings.admin_group)
            # (the engine's GPU workers hold device copies through serving, built below)
            self.engine = Engine(settings, Path(settings.state_dir) / "perfmodels.json", self.loaders.post, clock,
                                 gpu_devices=serve_gpu_devices(settings),
                                 worker_hold=lambda *args: self.serving.worker_hold(*args),
                                 answered=lambda: self.lane is not None and self.lane.flush_replies())
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.fetcher = Fetcher(registry=self.registry, repository=self.repository, remote=self.remote,
                               loaders=self.loaders, counters=self.counters, jobs=self.jobs, reply=self._reply,
                               redispatch=self._dispatch)
        parts = dict(registry=self.registry, loaders=self.loaders, counters=self.counters, jobs=self.jobs, clock=clock)
        self.residency = Residency(tier=self.host, policy=policy, settings=settings, source=self.fetcher,
                                   memory=self.memory, **parts)
        self.memory.host = self.residency
        self.gpus = GpuTiers(host=self.residency, settings=settings, make_policy=make_policy, **parts)
        self.models = Models(registry=self.registry, host=self.residency, gpus=self.gpus, fetcher=self.fetcher,
                             repository=self.repository, loaders=self.loaders, settings=settings, admins=self.admins,
                             counters=self.counters, jobs=self.jobs, clock=clock, wall=wall, reply=self._reply)
        self.disk_opens = DiskOpens(loaders=self.loaders, counters=self.counters)
        self.sessions = Sessions(registry=self.registry, host=self.residency, gpus=self.gpus, fetcher=self.fetcher,
                                 disk=self.disk_opens, settings=settings, counters=self.counters, clock=clock, wall=wall,
                                 reply=self._reply, open_latency=self.open_latency)
        self.ensembles = Ensembles(EnsembleStore(self.repository.root), resolve=self.fetcher.resolve,
                                   model_names=lambda: {n for n, _ in self.registry.models}, admins=self.admins)
        self.serving = Serving(registry=self.registry, host=self.residency, gpus=self.gpus, fetcher=self.fetcher,
                               engine=self.engine, loaders=self.loaders, admins=self.admins, clock=clock,
                               reply=self._reply, touch=self.sessions.touch, ensembles=self.ensembles,
                               responses=ResponseCache(settings.response_cache_bytes()), counters=self.counters)
        self.memory.caches.append(self.serving.drop_answers)   # (pressure: cached answers go before models,
        self.memory.caches.append(self.models.warm_packer.give_back)   # and an idle packing server)
        self.models.warm_up = self.serving.warm_up
        # Replacements swapped in while their version serves; their opens and requests wait meanwhile (swaps.py).
        # The wait: what a front's report (1 s) and its let-go take, as a repository load's (triton_repo/load.py).
        self.swaps = self.models.swaps = self.serving.swaps = Swaps(
            registry=self.registry, host=self.residency, repository=self.repository, clock=clock,
            redispatch=self._dispatch, wait_s=settings.front_hold_s + 1.0)
        self.fetcher.hold_back = self.swaps.hold_back
        # Message type -> handler(ident, message): each returns its reply, or None when it answers later.
        self.handlers = {**self.sessions.handlers(), **self.models.handlers(), **self.serving.handlers(),
                         P.ListModels: self.on_ListModels, P.Stats: self.on_Stats, P.Remove: self.on_Remove,
                         P.SetUnloaded: self.on_SetUnloaded, P.LogSettings: self.on_LogSettings}
        self.started = wall()
        # When the owner loop last came back from not listening (see serve_forever): silence before it is not counted.
        self.listening_since = float("-inf")
        self.turn_at = float("inf")             # when the owner loop's poll last returned (see sweep_clients)
        self.stop_requested = False
        self.reload_requested = False
        self.notifier = Notifier()
        self.metrics: MetricsServer | None = None
        self.cpu_utilization = CpuUtilization()   # Triton's nv_cpu_utilization, between two renders of the metrics
        self.log_settings = LogSettings()   # Triton's logging extension over this process's log
        self.children: list = []                # daemon/children.py: the fronts (http_port, grpc_port), the import
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
        # serve-mode calls, see modelcache/wire/lane.py
        self.lane = LaneServer(path, self.counters, settings.max_message_bytes()) if path else None
        if self.lane is not None:
            self.lane.on_close = self.sessions.connection_closed

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Scan the repository, create the host tier, bind the socket. After this, clients may connect."""
        addr = self.settings.socket
        self.fd_budget = FdBudget(raise_fd_limit())   # before any socket: see daemon/fds.py
        if addr.startswith("ipc://"):  # first: a daemon that refuses to start leaves nothing behind
            path = Path(addr[len("ipc://"):])
            lock = SocketLock(path)
            with storage_errors("starting the daemon", path.parent):
                path.parent.mkdir(parents=True, exist_ok=True)
                lock.acquire()
            try:
                if os.path.lexists(path):
                    check_socket_file(path)
                    self._refuse_if_live(addr)
                    with storage_errors("removing a dead daemon's socket", path):
                        path.unlink()
                if self.lane is not None:
                    check_socket_file(Path(self.lane.path))
            except BaseException:
                lock.release()
                raise
            self.socket_lock = lock   # from here the socket files are ours to remove (see _remove_socket_file)
        # The HTTP ports next, before the host tier exists: a port we cannot have is a one-line refusal.
        if self.settings.metrics_port:
            try:
                self.metrics = MetricsServer(self.settings.metrics_host, self.settings.metrics_port)
            except OSError as e:
                raise bind_error(e, self.settings.metrics_host, self.settings.metrics_port,
                                 f"metrics_port {self.settings.metrics_port}") from None
        from .children import daemon_children
        self.children = daemon_children(self.settings)
        for model_dir, manifest in self.repository.scan():
            self.registry.add_model(model_dir, manifest)
        adoption = adopt_resident_models(self.residency)   # warm restart: a dead daemon's host tier, checked
        with storage_errors("creating the host tier", self.host.root):
            self.host.start()
            self.gpus.start()
        settle_adopted(self.residency, adoption)
        # A dead daemon's tier is still charged to the cgroup: give back what the headroom needs before serving
        # (promoting over it is what got a restarted daemon OOM-killed again, in a loop under systemd).
        self.memory.relieve()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to vanished clients are dropped, not raised
        # A longer frame disconnects its sender before libzmq allocates it (big tensors go through shm files).
        self.router.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes())
        self.router_events = self.router.get_monitor_socket(zmq.EVENT_ACCEPTED)
        try:
            self._bind_router()
        except zmq.ZMQError as e:   # a tcp:// port in use, an address not this machine's
            raise ConfigError(f"socket {addr}: cannot listen there: {e.strerror}; choose another address, or stop "
                              "what holds it") from None
        self.wake_rx = self.ctx.socket(zmq.PULL)
        self.wake_rx.bind(WAKE_ADDR)
        self.engine.start(import_runtime=bool(self.settings.http_port or self.settings.grpc_port))   # (fronts serve)
        for model in list(self.registry.models.values()):   # (Triton warms a model at each start, as at each load)
            self.serving.warm_up(model)
        self.pressure_watch = PressureWatch(self.memory, self.loaders.post)
        self.pressure_watch.start()
        if self.metrics is not None:
            self.metrics.start()
            self.publish_metrics()
            log.info("metrics on http://%s:%d/metrics", self.settings.metrics_host, self.metrics.port)
        log.info("modelcache %s ready on %s: %d models in %s, host tier %s (%d MiB; memory limit %d MiB, %s, "
                 "%d MiB kept free)", __version__, addr, len(self.registry.models), self.repository.root,
                 self.host.root, self.host.capacity_bytes >> 20, self.memory.limit.limit_bytes >> 20,
                 self.memory.limit.source, self.memory.reserve >> 20)

    @staticmethod
    def _host_capacity(settings: Settings, limit) -> int:
        """host_capacity in bytes, a percentage of the memory limit; refused (or warned) above the limit less
        memory_reserve (memory.py)."""
        capacity = settings.host_capacity_bytes(limit.limit_bytes)
        check_capacity(capacity, limit, settings.memory_reserve_bytes(limit.limit_bytes), settings)
        return capacity

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
            for proc in list(self.models.packers):
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
            # The memory limit again (systemctl set-property MemoryMax=, a pod resized), and the new host_capacity
            # checked against it before anything changes: a refusal keeps every old setting.
            limit = read_limit()
            capacity = self._host_capacity(new, limit)
            changed = []
            for name in (f.name for f in dataclasses.fields(Settings)):
                old, value = getattr(self.settings, name), getattr(new, name)
                if value == old:
                    continue
                if name in self.LIVE_SETTINGS:
                    setattr(self.settings, name, value)
                    changed.append(name)
                    log.info("reload: %s %r -> %r", name, old, value)
                else:   # said, not dropped: the user changed it and expects to see it take effect
                    log.warning("reload: %s %r -> %r needs a restart of the daemon; keeping %r until then",
                                name, old, value, old)
            logging.getLogger("modelcache").setLevel(self.settings.log_level.upper())
            self.log_settings.levels.switch_on()   # (log_level is the whole say again, as at the start)
            self.memory.limit = limit
            self.residency.set_capacity(capacity)
            self.memory.reserve = self.settings.memory_reserve_bytes(limit.limit_bytes)
            if "gpu_capacity" in changed:
                self.gpus.set_capacity(self.settings.gpu_capacity)
            self.residency.admit()   # more room: requests waiting for it go now, in every tier
            self.engine.settings_changed()
            self.serving.responses.resize(self.settings.response_cache_bytes())
            log.info("reloaded settings: %s", ", ".join(changed) + " applied" if changed else "nothing changed live")
        except ModelCacheError as e:
            log.error("reload failed, keeping the old settings: %s", e)
        self.notifier.ready(self.status_line())

    def status_line(self) -> str:
        resident = sum(1 for m in self.registry.models.values() if m.state is ModelState.RESIDENT)
        gpus = "".join(f", GPU {t.device.index} {t.used_bytes >> 20}/{t.capacity_bytes >> 20} MiB"
                       for t in (r.tier for r in self.gpus))
        return (f"{plural(len(self.registry.models), 'model')} ({resident} resident), "
                f"{plural(len(self.registry.clients), 'client')}, "
                f"host {self.host.used_bytes >> 20}/{self.host.capacity_bytes >> 20} MiB{gpus}")

    def publish_metrics(self) -> None:
        """modelcache's metrics, then Triton's (triton_metrics.py), rendered for the metrics thread to serve."""
        if self.metrics is None:
            return
        tiers, models, executor = self._describe_tiers(), self._describe_models(), self.engine.describe()
        cached = {m.key for m in self.registry.models.values() if self.serving.caches(m)}
        cache = self._response_cache()
        self.metrics.publish(render(self.counters, tiers, models, len(self.registry.clients),
                                    self.wall() - self.started, self.open_latency, [s.value for s in ModelState],
                                    {**executor, "response_cache": cache}, self.engine.latency_by_model) +
                             render_triton(models, executor["models"], executor["queued_by_model"], cached,
                                           self.cpu_utilization.sample(), machine_memory(), cache))

    def serve_forever(self, on_ready=None) -> None:
        try:
            self.start()
        except BaseException:
            self._abort_start()
            raise
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.wake_rx, zmq.POLLIN)
        poller.register(self.router_events, zmq.POLLIN)
        if self.lane is not None:
            self.lane.start(poller)
            self.lane.budget = self.fd_budget
        self.notifier.ready(self.status_line())
        for child in self.children:   # once the lane listens: a front's first request may come at once
            child.start()
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
                # A batching window ends; a keep-alive, a pre-warm or a request's wait for room is due (daemon/residency/).
                wake_at = min([next_sweep, self.engine.next_wakeup() or next_sweep,
                               self.serving.next_timer() or next_sweep,
                               self.swaps.next_timer() or next_sweep,
                               *(t for r in self.tiers() if (t := r.next_timer()) is not None)])
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
                    self.loaders.apply_completions()
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
                self.serving.on_timer(self.clock())   # sequences idle too long end (executor/sequences.py)
                self.swaps.on_timer(self.clock())     # a replacement waiting for its version to be let go
                for residency in self.tiers():
                    residency.on_timer(self.clock())
                if self.clock() >= next_sweep:
                    self._check_fds()
                    self.sweep_clients()
                    self.engine.save_perf_models(self.clock())
                    for key in self.engine.drop_idle(self.clock(), self.settings.serve_idle_s):
                        log.info("serve sessions of %s dropped after %.0f s idle", key, self.settings.serve_idle_s)
                    self.publish_metrics()
                    for child in self.children:
                        child.check()
                    self.models.warm_packer.stop_if_idle()
                    next_sweep = self.clock() + min(self.settings.heartbeat_interval_s,
                                                    self.notifier.watchdog_interval_s or 1e9)
                # Everything that came this turn is queued (and whatever a timer or a completion let go): the engine
                # batches what came together and runs what it can; then the turn's answers leave, one write a connection.
                self.engine.step()
                if self.lane is not None:
                    self.lane.flush_replies()
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        """Graceful stop: finish running loads and packs, answer everyone waiting, then remove our traces."""
        self.notifier.stopping()
        for child in self.children:   # first: the drain below answers the fronts' requests in flight
            child.terminate()
        log.info("stopping: %d clients, %d leases, %d jobs in flight", len(self.registry.clients),
                 len(self.residency.leases), len(self.jobs))
        for residency in self.tiers():
            residency.stop_waiting()
        deadline = self.clock() + 60
        while self.engine.requests and self.clock() < deadline:  # in-flight inferences finish first
            if self.wake_rx.poll(10):
                while self.wake_rx.poll(0):
                    self.wake_rx.recv()
            self.loaders.apply_completions()
            self.engine.step()
            self.engine.on_timer(self.clock())
            if self.lane is not None:
                self.lane.flush_replies()
        # From here each step on its own: one that fails (a full state directory, a disk answering EIO) is
        # logged, and the rest still run; the sockets and the host tier always go.
        self._each_step("stopping", (
            lambda: self.pressure_watch is not None and self.pressure_watch.stop(),
            self.loaders.shutdown,
            self.models.warm_packer.stop,   # (after the packs: shutdown waited for them)
            self.engine.stop,      # (saves the performance models: a failure is logged there, once)
            lambda: self.lane is not None and self.lane.stop(),
            lambda: self.router_events is not None and (self.router.disable_monitor(),
                                                        self.router_events.close(linger=0)),
            # let the last answers (drained above) reach their clients
            lambda: self.router is not None and self.router.close(linger=2000),
            lambda: self.wake_rx is not None and self.wake_rx.close(linger=0),
            lambda: self.metrics is not None and self.metrics.stop(),
            *(child.wait for child in self.children),
            self._remove_socket_file,
            # Clients that still map a model keep their pages (host and GPU): freeing only drops our references.
            self.gpus.stop,
            lambda: self.host.stop(keep=self.settings.keep_host_tier),  # kept: the next daemon here re-adopts it
            self.notifier.close))

    @staticmethod
    def _each_step(doing: str, steps) -> None:
        for step in steps:
            try:
                step()
            except Exception as e:   # (a traceback only for what no disk explains: a bug)
                log.error("%s: %s", doing, e if isinstance(e, ModelCacheError) else f"{type(e).__name__}: {e}",
                          exc_info=not isinstance(e, (ModelCacheError, OSError)))

    def _abort_start(self) -> None:
        """A start that failed part way (a port, a device, a full /dev/shm): undo what it did, so that nothing
        is left behind: no socket file, no host tier, no listening port, no thread keeping the process up."""
        for close in (*(child.close for child in self.children),
                      lambda: self.metrics and self.metrics.httpd.server_close(),
                      lambda: self.router_events is not None and self.router_events.close(linger=0),
                      lambda: self.router is not None and self.router.close(linger=0),
                      lambda: self.wake_rx is not None and self.wake_rx.close(linger=0),
                      lambda: self.pressure_watch is not None and self.pressure_watch.stop(),
                      self.loaders.shutdown, self._remove_socket_file, self.gpus.stop,
                      lambda: self.host.stop(keep=self.settings.keep_host_tier), self.notifier.close):
            try:
                close()
            except Exception:   # each step on its own: the start's own error is the one to report
                log.debug("while undoing a failed start", exc_info=True)

    def _remove_socket_file(self) -> None:
        if self.socket_lock is None:   # not ours: a refused start must not remove the running daemon's socket
            return
        addr = self.settings.socket
        paths = [addr[len("ipc://"):]] if addr.startswith("ipc://") else []
        paths += [self.lane.path] if self.lane is not None else []
        for path in paths:
            error = remove_tree(path)
            if error is not None:
                log.error("could not remove the socket file %s: %s; remove it by hand", path, error)
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
            handler = self.handlers.get(type(msg))
            if handler is None:
                refused = ProtocolError(f"{msg.KIND.decode()!r} is a reply, not a request")
                refused.declared_fds = getattr(msg, "ipc_fds", 0)
                raise refused
        except ProtocolError as e:
            if not self._passed_fds_taken(ident, getattr(e, "declared_fds", None)):
                return
            self.counters["bad_messages"] += 1
            log.warning("bad message from a client: %s", e)
            self._reply(ident, P.ErrorReply(req_id=P.req_id_of(body) if body else 0, code=e.code, message=str(e)))
            return
        if getattr(msg, "ipc_fds", 0):
            try:
                taken = self._take_passed(ident, msg.ipc_fds, getattr(msg, "lent_fds", 0))
            except ModelCacheError as e:
                self._reply(ident, P.ErrorReply(req_id=msg.req_id, code=e.code, message=str(e)))
                return
            if taken is None:
                return
            msg.passed, msg.lent = taken
        self._dispatch(ident, msg, handler)

    def _take_passed(self, ident, n: int, lent: int) -> tuple | None:
        """The memory files a request's `ipc_fds` declares, taken off its lane connection: (its inputs' files, mapped:
        wire/tensors.py map_passed_inputs; the last `lent` ones, lent for its outputs: wire/lent_outputs.LentFiles,
        which owns their descriptors). None where the connection was dropped (it did not bring them: the stream is
        broken)."""
        if type(ident) is not LaneConnection:
            raise InputError(f"the request declares {n} passed descriptors, which only the daemon's lane (a Unix "
                             "socket) carries: this came over ZeroMQ")
        fds = ident.take_fds(n)
        if fds is None:
            return None
        inputs, lent = fds[:n - lent], fds[n - lent:]
        try:
            mapped = tensors.map_passed_inputs(inputs)
        except BaseException:
            for fd in lent:
                os.close(fd)
            raise
        finally:
            for fd in inputs:
                os.close(fd)
        return mapped, LentFiles(lent) if lent else None

    def _passed_fds_taken(self, ident, declared: int | None) -> bool:
        """A refused lane request's descriptors, closed (so that the next message does not get them); False where
        the connection had to be dropped: it holds descriptors the refused message may or may not have brought."""
        if type(ident) is not LaneConnection or not ident.fds:
            return True
        if declared is None or declared < 0:
            ident.server.drop(ident, "a message that could not be read came with file descriptors")
            return False
        fds = ident.take_fds(declared)
        for fd in fds or ():
            os.close(fd)
        return fds is not None

    def _dispatch(self, ident: bytes, msg, handler=None) -> None:
        """Run a request's handler and send its reply or its error; also used to re-run a request."""
        handler = handler or self.handlers[type(msg)]
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
        """Answer on the transport the request came by: a ZeroMQ routing id, or a lane connection. A reply's
        `passed_fds` (a lease's files, or GPU allocations) are its own: sent as copies, then closed."""
        fds = getattr(msg, "passed_fds", ())
        try:
            kind, body = P.encode(msg)
            if type(ident) is LaneConnection:
                ident.send(kind, body, fds)
                return
        finally:
            for fd in fds:
                os.close(fd)
        if fds:   # refused before (GpuTiers.check_transport, lease_files.wanted): never half an answer
            log.error("a reply with file descriptors for a ZeroMQ peer was not sent")
            msg = P.ErrorReply(req_id=msg.req_id, code="internal", message="internal error: file descriptors cannot "
                               "go over ZeroMQ; open over the lane")
            kind, body = P.encode(msg)
        try:
            send = self.router.send
            send(ident.routing_id, _SEND_MORE)
            send(kind, _SEND_MORE)
            send(body, _SEND_LAST)
        except zmq.ZMQError as e:  # the client is gone or its queue is full: its loss
            log.debug("reply dropped: %s", e)

    # -- handlers of the daemon's own: listings and stats -------------------------------
    def on_ListModels(self, ident, msg: P.ListModels):
        return P.ModelList(req_id=msg.req_id, models=self._describe_models(),
                           remote=self.remote.url if self.remote is not None else "")

    def _describe_models(self) -> list[dict]:
        listed = [self.models.describe(m) for _, m in sorted(self.registry.models.items())] + \
            [describe_unreadable(n, v, why) for (n, v), why in sorted(self.repository.unreadable.items())] + \
            self.ensembles.listing()
        for entry in listed:
            entry["unloaded"] = entry["name"] in self.registry.unloaded
            entry["warming"] = f"{entry['name']}@{entry['version']}" in self.serving.warming
        return listed

    def on_SetUnloaded(self, ident, msg: P.SetUnloaded):
        """A protocol front's unload (or its load, unloaded False) of a model or an ensemble, for every front."""
        ensemble = self.ensembles.find(msg.name, None)
        if ensemble is not None:
            self.admins.check_owner(ident, ensemble.key, ensemble.owner_uid, "unload")
        else:   # (NOT_FOUND, in the registry's words, for a name that is neither)
            self.admins.check_model_owner(ident, self.fetcher.resolve(msg.name, None), "unload")
        if msg.unloaded and msg.name not in self.registry.unloaded:
            log.info("model %s unloaded: not ready over the protocol fronts until it is loaded", msg.name)
        (self.registry.unloaded.add if msg.unloaded else self.registry.unloaded.discard)(msg.name)
        return P.Ack(req_id=msg.req_id)

    def on_LogSettings(self, ident, msg: P.LogSettings):
        """Triton's logging extension: the daemon's log settings, updated by an admin (log_settings.py)."""
        if msg.update:
            if not self.admins.is_admin(ident):
                raise PermissionDenied("permission denied: only admins (root, the daemon's user, admin_group) may "
                                       "change the daemon's log settings")
            before = self.log_settings.settings()
            after = self.log_settings.apply(msg.update)
            changed = {k: v for k, v in after.items() if before[k] != v}
            if changed:
                log.warning("log settings changed over a protocol front: %s", changed)
                self.settings.log_level = logging.getLevelName(self.log_settings.logger.getEffectiveLevel()).lower()
        return P.LogSettingsReply(req_id=msg.req_id, settings=self.log_settings.settings())

    def on_Remove(self, ident, msg: P.Remove):
        """A model's version, or an ensemble's (daemon/ensembles.py)."""
        reply = self.ensembles.remove(ident, msg) or self.models.on_Remove(ident, msg)
        self.serving.drop_answers(msg.name)   # (every version's: answers are cheap to compute again, removal rare)
        return reply

    def on_Stats(self, ident, msg: P.Stats):
        now = self.clock()
        admin = self.admins.is_admin(ident)
        clients = []
        for c in self.registry.clients.values():
            entry = {"client_id": c.client_id, "pid": c.pid, "name": c.name, "leases": len(self.residency.leases.of_client(c.client_id)),
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
                            executor={**self.engine.describe(), "response_cache": self._response_cache(),
                                      "lane_connections": len(self.lane.conns) if self.lane else None})

    def _response_cache(self) -> dict:
        """The daemon's response cache (its answers, bytes, evictions) with every model's hits and misses, the
        fronts' own caches' included."""
        return {**self.serving.responses.describe(), **self.engine.cache_counts()}

    def tiers(self) -> list:
        """Each memory tier's residency manager: the host tier's, then each GPU's."""
        return [self.residency, *self.gpus]

    def _describe_tiers(self) -> list[dict]:
        host, *gpus = (r.describe() for r in self.tiers())
        return [{**host, **self.memory.describe()}, *gpus,
                {"tier": "disk", "path": str(self.repository.root),
                 "used_bytes": sum(m.manifest.weights_bytes for m in self.registry.models.values()),
                 "capacity_bytes": 0}]

    def _wake(self) -> None:
        """From any thread: wake the owner loop (a loader or the executor posted a completion)."""
        wake = getattr(self._thread_sockets, "wake", None)
        if wake is None:  # one PUSH socket per posting thread: sockets are not thread-safe, and
            wake = self._thread_sockets.wake = self.ctx.socket(zmq.PUSH)  # one per post cost ~70 us
            wake.setsockopt(zmq.LINGER, 0)
            wake.connect(WAKE_ADDR)
        try:
            wake.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the owner is stopping, or already has a wake-up queued: either way it will look

    # -- client liveness ---------------------------------------------------------------
    def sweep_clients(self) -> None:
        """Release the leases of clients that stopped sending heartbeats or whose process died."""
        now = self.clock()
        if now - self.turn_at > self.settings.lease_timeout_s / 2:
            # Stopped after this turn's poll and before this reading: what arrived meanwhile is unread. Judged
            # on the same reading as the silence below: a check made a few calls earlier left a window (a
            # SIGSTOP landing in _check_fds dropped every live client in CI).
            self.listening_since = now
        self.sessions.sweep(now, self.listening_since)


def run(settings: Settings, on_ready=None, reload_settings=None, make_policy=policy_for) -> None:
    daemon = Daemon(settings, reload_settings=reload_settings, make_policy=make_policy)
    signal.signal(signal.SIGTERM, daemon.request_stop)
    signal.signal(signal.SIGINT, daemon.request_stop)
    signal.signal(signal.SIGHUP, daemon.request_reload)
    daemon.serve_forever(on_ready)
    log.info("stopped")
