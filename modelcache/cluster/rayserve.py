"""modelcache on a Ray cluster: a daemon per node, a Ray Serve replica per node, requests routed to warm nodes.

- `NodeDaemon`, a Ray actor pinned to its node (one per node, named after the node id): adopts the daemon that
  answers at the node's socket (the systemd unit's), or starts one and restarts it if it dies, as systemd would.
- `ModelcacheReplica`, the Serve deployment, one replica per node (`max_replicas_per_node=1`): it answers
  requests through its node's daemon in serve mode. The model is Serve's multiplexed model id; loading it
  (`get_model`) is a prefetch into the node's host tier. If the node's daemon is gone, the replica hands the
  request to another node instead of failing it.
- `LocalityRouter`, the deployment's request router: ranks replicas by `routing.LocalityPolicy` over what each
  replica reports of its daemon (`record_routing_stats`: models by tier, queue). Each daemon keeps its own
  eviction policy; the cluster view is the daemons' stats, not a second registry.

Needs the `[ray]` extra. `modelcache cluster up|status|down` drive it from the command line.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import DaemonUnavailable, ModelCacheError
from .routing import WARM_TIERS, LocalityPolicy, NodeView, OpenCosts

NAMESPACE = "modelcache"
APP_NAME = "modelcache"
ROUTING_STATS_PERIOD_S = 0.5      # how stale a router's view of the daemons may be (Serve's default is 10 s)


def daemon_actor_name(node_id: str) -> str:
    return f"modelcache-daemon-{node_id}"


def _daemon_stats(address: str, timeout_s: float) -> dict:
    """The stats of the daemon at `address` as plain data, or {"up": False, "error": ...} when it does not answer."""
    from ..client.connection import connect
    try:
        with connect(address, timeout_s=timeout_s, lane=False) as c:
            reply = c.stats()
    except ModelCacheError as e:
        return {"up": False, "error": str(e)}
    return {"up": True, "models": reply.models, "tiers": reply.tiers, "counters": reply.counters,
            "clients": len(reply.clients), "executor": reply.executor}


@ray.remote(num_cpus=0, max_concurrency=4)
class NodeDaemon:
    """The modelcache daemon of the node this actor is pinned to."""

    def __init__(self, settings: dict, log_path: str = ""):
        self.node_id = ray.get_runtime_context().get_node_id()
        self.settings = {k: str(v) for k, v in settings.items()}
        self.env = daemon_env(self.settings)
        # The socket the daemon we would start listens on, hence where the node's own daemon (the systemd
        # unit's, or one started by hand) answers: the built-in default alone missed one whose socket a
        # config file or MODELCACHE_SOCKET set, and the daemon started beside it collided with it.
        self.address = daemon_address(self.env)
        self.log_path = log_path or os.path.join(_ray_logs_dir(), f"modelcache-daemon-{self.node_id[:12]}.log")
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.restarting = True           # False: a daemon that dies stays down (see set_restarts)
        self._stopping = False
        if not _daemon_stats(self.address, timeout_s=2)["up"]:
            started = threading.Event()
            self._start_error: Exception | None = None
            threading.Thread(target=self._supervise, args=(started,), name="modelcache-supervise", daemon=True).start()
            started.wait()
            if self._start_error is not None:
                raise self._start_error

    def _start(self, timeout_s: float = 60.0) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "daemon"], env=self.env,
                                         stdout=subprocess.PIPE, stderr=log, preexec_fn=_stop_with_parent)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                if self.proc.stdout.readline().startswith(b"READY"):
                    return
        why = _last_line(self.log_path) if self.proc.poll() is not None else f"not ready after {timeout_s:.0f} s"
        raise ModelCacheError(f"the modelcache daemon on node {self.node_id[:12]} did not start: {why} "
                              f"(its log: {self.log_path})")

    def _supervise(self, started: threading.Event) -> None:
        """Start our daemon, and restart it when it dies (it re-adopts the host tier a crash leaves), as the
        systemd unit does. This thread is the daemon's parent: if the actor dies, the daemon gets SIGTERM."""
        backoff_s = 0.2
        while not self._stopping:
            dead = self.proc is None or self.proc.poll() is not None
            if dead and not self._stopping and (self.restarting or self.proc is None):
                restart = self.proc is not None
                try:
                    self._start()
                    self.restarts += restart
                    backoff_s = 0.2
                except Exception as e:
                    if not started.is_set():
                        self._start_error = e
                        started.set()
                        return
                    time.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, 5.0)
                started.set()
            time.sleep(0.2)

    def set_restarts(self, enabled: bool) -> None:
        """Whether a daemon that dies is restarted (on by default). Off: it stays down until turned on again,
        e.g. while a node is being looked at; requests for that node go to others meanwhile."""
        self.restarting = enabled

    def info(self) -> dict:
        return {"node_id": self.node_id, "address": self.address, "owned": self.proc is not None,
                "pid": self.proc.pid if self.proc is not None else None, "restarts": self.restarts}

    def stats(self) -> dict:
        return _daemon_stats(self.address, timeout_s=5)

    def stop(self) -> None:
        """Stop the daemon this actor started (one it adopted is the node's to stop)."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def daemon_env(settings: dict) -> dict:
    """The environment a node's daemon starts in: the actor's own, with `settings` as MODELCACHE_* variables."""
    return {**os.environ, **{f"MODELCACHE_{k.upper()}": str(v) for k, v in settings.items()}}


def daemon_address(env: dict) -> str:
    """The socket a daemon started in `env` listens on, resolved by its settings' layers: its config file
    ($MODELCACHE_CONFIG or the default one), then its environment."""
    from ..config import load
    return load(env=env, only=("socket",)).socket


def _last_line(path: str) -> str:
    """A stopped daemon's last log line: its one-line `modelcache: ...` error."""
    try:
        with open(path, "rb") as f:
            lines = f.read()[-4096:].decode(errors="replace").strip().splitlines()
    except OSError:
        return "it exited"
    return lines[-1] if lines else "it exited without a word"


def _ray_logs_dir() -> str:
    """The Ray session's log directory (with the raylet's and workers' logs, and cleaned up with them)."""
    try:
        return ray._private.worker.global_worker.node.get_logs_dir_path()
    except Exception:   # (a private API: should it move, the temp dir)
        return tempfile.gettempdir()


def _stop_with_parent() -> None:
    """In the daemon's process before exec: SIGTERM when the thread that started it dies (Linux), so a killed
    actor (a cluster shut down, a node drained) never leaves a daemon and its host tier behind."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_daemons(settings=None) -> list[dict]:
    """A NodeDaemon on every alive node (one that exists is kept). `settings`: a dict of daemon settings for
    every node, or a function of the node (an entry of `ray.nodes()`) giving that node's; {} adopts or starts
    the node's daemon on its defaults."""
    infos = []
    for node in sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"]):
        node_settings = settings(node) if callable(settings) else (settings or {})
        actor = NodeDaemon.options(
            name=daemon_actor_name(node["NodeID"]), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(node_settings)
        infos.append(actor.info.remote())
    return ray.get(infos)


def daemon_actors() -> dict:
    """node id -> its NodeDaemon actor, for the nodes that have one."""
    actors = {}
    for node in ray.nodes():
        try:
            actors[node["NodeID"]] = ray.get_actor(daemon_actor_name(node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            pass
    return actors


def stop_daemons(timeout_s: float = 30.0) -> int:
    """Stop every NodeDaemon (and the daemons they started); returns once their names are free again, so a
    start_daemons right after makes new ones rather than finding the dying ones."""
    actors = daemon_actors()
    ray.get([a.stop.remote() for a in actors.values()])
    for a in actors.values():
        ray.kill(a)
    deadline = time.monotonic() + timeout_s
    while daemon_actors() and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(actors)


class LocalityRouter(FIFOMixin, MultiplexMixin, RequestRouter):
    """Serve request router: the replica whose node opens the request's model soonest (see routing.py)."""

    def initialize_state(self, remember_s: float = 5.0, **costs) -> None:
        self.policy = LocalityPolicy(OpenCosts(**costs), remember_s=remember_s)

    def _view(self, replica: RunningReplica) -> NodeView:
        stats = replica.routing_stats or {}
        view = NodeView.from_dict({"node_id": replica.node_id, **stats}) if stats else \
            NodeView(node_id=replica.node_id)
        view.node_id = replica.replica_id.unique_id        # one view per replica, whatever shares a node
        queue = self.replica_queue_len_cache.get(replica.replica_id)
        if queue is not None:                              # fresher than the stats
            view.queue = queue
        return view

    async def choose_replicas(self, candidate_replicas: list, pending_request: PendingRequest | None = None):
        model = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not model:
            return [candidate_replicas]
        avoid = set((pending_request.kwargs or {}).get("avoid", ()))
        replicas = [r for r in candidate_replicas if r.node_id not in avoid] or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in replicas}
        # One replica per rank: Serve tries them in this order (a full one is skipped), and the policy takes the
        # first as where the request goes. (on_request_routed is only called under strict max_ongoing_requests.)
        return [[by_id[i]] for i in self.policy.order(model, [self._view(r) for r in replicas])]


class ModelcacheReplica:
    """Answers inference requests through its node's daemon (serve mode, over the lane)."""

    def __init__(self):
        from ..client.connection import connect
        self.node_id = ray.get_runtime_context().get_node_id()
        actor = ray.get_actor(daemon_actor_name(self.node_id), namespace=NAMESPACE)
        self.address = ray.get(actor.info.remote())["address"]
        self.client = connect(self.address)
        self.in_flight = 0
        self.service_ms = 10.0            # a moving mean of a warm request's time, for the router's queue estimate
        self._stats_pending = False       # a record_routing_stats call is waiting on the daemon
        ctx = serve.get_replica_context()
        self._handle = serve.get_deployment_handle(ctx.deployment, ctx.app_name)

    @serve.multiplexed(max_num_models_per_replica=16)
    async def get_model(self, model_id: str) -> str:
        await asyncio.to_thread(self.client.load, model_id)   # into the host tier (from disk or the remote store)
        return model_id

    def _tier(self, model: str) -> str:
        versions = [m for m in self.client.list() if m["name"] == model and m.get("state") != "corrupt"]
        return max(versions, key=lambda m: m["version"])["tier"] if versions else "remote"

    async def __call__(self, inputs: dict, model: str = "", avoid: tuple = ()) -> dict:
        """Run `model` (default: the request's multiplexed model id) on `inputs` (name -> array)."""
        model = model or serve.get_multiplexed_model_id()
        if not model:
            raise ValueError("name the model: handle.options(multiplexed_model_id=NAME), or model=NAME")
        started = time.perf_counter()
        self.in_flight += 1
        try:
            tier = await asyncio.to_thread(self._tier, model)
            await self.get_model(model)
            outputs, _ = await asyncio.to_thread(self.client.infer, model, inputs)
        except DaemonUnavailable:
            # This node's daemon is gone: the request goes to another node, not back to the caller as an error.
            if self.node_id in avoid:
                raise
            return await self._handle.options(multiplexed_model_id=model).remote(
                inputs, model=model, avoid=(*avoid, self.node_id))
        finally:
            self.in_flight -= 1
        elapsed_ms = 1000 * (time.perf_counter() - started)
        if tier in WARM_TIERS:    # the time a queued request waits for: loads are priced by the router apart
            self.service_ms += 0.2 * (elapsed_ms - self.service_ms)
        return {"outputs": outputs, "node": self.node_id, "tier": tier, "warm": tier in WARM_TIERS,
                "ms": elapsed_ms, "failed_over_from": list(avoid)}

    async def record_routing_stats(self) -> dict:
        # Serve asks every ROUTING_STATS_PERIOD_S whether or not the last answer came: while a stats call
        # still waits on a stuck daemon, another would only queue behind it (and the requests behind both).
        if self._stats_pending:
            return {"node_id": self.node_id, "up": False}
        self._stats_pending = True
        try:
            stats = await asyncio.to_thread(self.client.stats)
        except ModelCacheError:
            return {"node_id": self.node_id, "up": False}
        finally:
            self._stats_pending = False
        return NodeView.from_stats(self.node_id, stats, queue=self.in_flight, service_ms=self.service_ms).to_dict()

    def __del__(self):
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


def deploy(router: str = "locality", replicas: int | None = None, app_name: str = APP_NAME,
           max_ongoing_requests: int = 8, remember_s: float = 5.0):
    """Run the modelcache Serve app: one replica per node (default: as many as nodes with a daemon).
    router: "locality" (LocalityRouter) or "default" (Ray Serve's own, power of two choices). Returns its handle."""
    replicas = replicas or len(daemon_actors())
    options = dict(num_replicas=replicas, max_replicas_per_node=1, max_ongoing_requests=max_ongoing_requests,
                   ray_actor_options={"num_cpus": 0})
    if router == "locality":
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=LocalityRouter, request_router_kwargs={"remember_s": remember_s},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S, request_routing_stats_timeout_s=2.0)
    elif router != "default":
        raise ValueError(f"router {router!r}: use 'locality' or 'default'")
    app = serve.deployment(ModelcacheReplica, name="modelcache").options(**options).bind()
    return serve.run(app, name=app_name, route_prefix=None)


def infer(handle, model: str, inputs: dict, multiplexed: bool = True):
    """One request through the app's handle; multiplexed=False sends the model in the body instead, so that
    Serve's router knows nothing of it (the baseline the benchmark compares with)."""
    if multiplexed:
        return handle.options(multiplexed_model_id=model).remote(inputs)
    return handle.remote(inputs, model=model)


def cluster_status() -> list[dict]:
    """Per node: its daemon, the models by tier, the load."""
    rows = []
    for node_id, actor in sorted(daemon_actors().items()):
        info, stats = ray.get([actor.info.remote(), actor.stats.remote()])
        row = {**info, "up": stats.get("up", False)}
        if row["up"]:
            view = NodeView.from_stats(node_id, stats)
            by_tier: dict = {}
            for name, tier in sorted(view.tiers.items()):
                by_tier.setdefault(tier, []).append(name)
            executor = stats.get("executor") or {}
            row.update(models=by_tier, host_used=view.host_used, host_capacity=view.host_capacity,
                       clients=stats["clients"], in_flight=executor.get("in_flight", 0),
                       fetched=stats["counters"].get("fetched", 0))
        else:
            row["error"] = stats.get("error", "")
        rows.append(row)
    return rows
