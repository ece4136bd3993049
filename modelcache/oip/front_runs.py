"""Short models run by the front itself, in its own process, over the daemon's shared weights.

Through the daemon, a tiny model's request costs two processes' Python (the front's and the daemon's, ~0.4 ms
each here) around a 0.05 ms run; Triton's whole request costs 0.15-0.5 ms (benchmarks/grpc/NOTES.md). Where all
the engine would do with a request is run it alone, inline, at batch 1 (`Engine.front_may_run`: one stage,
serial batching, CPU workers, a measured run within `inline_run_ms`), the daemon's Describe says so, and the
front runs it the way any attach-mode client does: an ORT session in this process over the host tier's shared
memory (client/session.py), nothing read or copied, one intra-op thread that does not spin, on the front's
loop. The daemon keeps what it owns: the lease keeps the copy resident and is let go `front_hold_s` after the
model's last request here (or when this front unloads it), and what the engine would have counted (requests,
their times, the model's last call for the eviction policy) the front reports once a second (FrontServed), so
statistics, metrics and keep-alive see every request. A model the daemon has not run yet, a stateful or split
one, a batching one, and any request while the session opens, go to the daemon as before.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from ..errors import ModelCacheError, RequestTimeout, RunError
from ..executor.stats import INFER_BUCKETS_S, add_batch, add_batches
from ..histogram import Histogram
from ..memlimit import release_freed_heap
from ..wire import protocol as P, tensors

log = logging.getLogger("modelcache.front")

REPORT_EVERY_S = 1.0


class _Open:
    """One model version's session here, and when a request last used it."""

    __slots__ = ("sess", "last", "outputs")

    def __init__(self, sess, now: float):
        self.sess = sess
        self.last = now
        self.outputs = [o.name for o in sess.get_outputs()]


class _Served:
    """What the engine would have counted of one model version's requests run or answered from this front's response
    cache since the last report."""

    __slots__ = ("latency", "samples", "run_s", "failed", "failed_s", "last_unix_ms", "cache_hits", "cache_hit_s",
                 "cache_misses", "cache_miss_s", "batches")
    COUNTS = ("samples", "run_s", "failed", "failed_s", "cache_hits", "cache_hit_s", "cache_misses", "cache_miss_s")

    def __init__(self):
        self.latency = Histogram(INFER_BUCKETS_S)   # successes: run here, or answered from this front's cache
        self.samples = 0
        self.run_s = 0.0
        self.failed = 0
        self.failed_s = 0.0
        self.last_unix_ms = 0
        self.cache_hits = 0       # this front's response cache (oip/operations.py): as the engine counts its own
        self.cache_hit_s = 0.0
        self.cache_misses = 0     # (only those run here: the daemon counts those it served, from its cache or not)
        self.cache_miss_s = 0.0
        self.batches: dict = {}   # runs by their rows, as the engine's (executor/stats.add_batch)

    def absorb(self, other: "_Served") -> None:
        self.latency.merge(other.latency.counts, other.latency.total)
        add_batches(self.batches, other.batches)
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.last_unix_ms = max(self.last_unix_ms, other.last_unix_ms)

    def wire(self) -> dict:
        return {"counts": self.latency.counts, "success_s": self.latency.total, "last_unix_ms": self.last_unix_ms,
                "batches": self.batches, **{name: getattr(self, name) for name in self.COUNTS}}


class FrontRunner:
    """The sessions this front runs models on, opened in the background and let go when idle."""

    def __init__(self, link, settings, front: str, clock=time.monotonic, answers=None):
        self.link = link                  # oip/link.py: the reports go over it
        self.answers = answers            # the front's response cache (oip/operations.py), dropped when the daemon
        self._drops_seen = None           # drops its own under memory pressure (FrontServedReply.answers_dropped)
        self.socket = settings.socket
        self.timeout_s = settings.request_timeout_s
        self.hold_s = settings.front_hold_s
        self.client_name = f"{front}-front"
        self.clock = clock
        self._client = None               # client/leases.py LeaseClient, made with the first open
        self._client_lock = threading.Lock()   # (two models may open at once, on two executor threads)
        self._open: dict[tuple[str, int], _Open] = {}
        self._opening: dict[tuple[str, int], asyncio.Future] = {}   # key -> its open, on an executor thread
        self._letting_go: set[str] = set()   # names this front is unloading: none opens meanwhile
        self._refused: dict[tuple[str, int], float] = {}   # key -> when its open failed: the daemon serves it meanwhile
        self._served: dict[str, _Served] = {}              # "name@version" -> since the last report
        self._task: asyncio.Task | None = None

    def session(self, name: str, version: int):
        """The model's open session here, or None: then it opens in the background, and the caller sends this
        request to the daemon."""
        key = (name, version)
        held = self._open.get(key)
        if held is not None:
            held.last = self.clock()
            return held
        if key not in self._opening and name not in self._letting_go \
                and self.clock() - self._refused.get(key, -1e9) > self.hold_s:
            opening = self._opening[key] = asyncio.get_running_loop().run_in_executor(None, self._open_now, key)
            opening.add_done_callback(lambda done: self._opened(key, done.result()))
            self._start()
        return None

    def run(self, name: str, version: int, held: _Open, feeds: dict, output_names: list | None, max_batch: int,
            deadline: float | None, started: float) -> dict:
        """The outputs, run here; the errors the engine gives for the same request."""
        key = f"{name}@{version}"
        try:
            if deadline is not None and self.clock() > deadline:
                raise RequestTimeout(f"{key}: the request's deadline passed before it ran")
            samples = tensors.request_rows(feeds)
            tensors.check_request(key, name, samples, max_batch, output_names, held.outputs)
            names = output_names or held.outputs
            t0 = self.clock()
            try:
                values = held.sess.run(names, feeds)
            except ModelCacheError:
                raise
            except Exception as e:   # (its feeds were checked: the model or the runtime failed, as RunError says)
                raise RunError(f"{key}: {type(e).__name__}: {e}") from None
            done = self.clock()
        except ModelCacheError:
            served = self._served_of(key)
            served.failed += 1
            served.failed_s += self.clock() - started
            raise
        served = self._served_of(key)
        served.latency.observe(done - started)
        served.samples += samples
        served.run_s += done - t0
        add_batch(served.batches, samples, 1, done - t0)
        return dict(zip(names, values))

    def cache_hit(self, name: str, version: int, started: float, lookup_s: float) -> None:
        """A request this front answered from its response cache: a success that never ran, as the engine's."""
        served = self._served_of(f"{name}@{version}")
        served.latency.observe(self.clock() - started)
        served.cache_hits += 1
        served.cache_hit_s += lookup_s
        self._start()

    def cache_missed(self, name: str, version: int, seconds: float) -> None:
        served = self._served_of(f"{name}@{version}")
        served.cache_misses += 1
        served.cache_miss_s += seconds
        self._start()

    def keep_reporting(self) -> None:
        """This front holds answers in its response cache: report once a second from now (_report), if not yet."""
        self._start()

    async def let_go(self, name: str) -> None:
        """This front unloads the model: its sessions here go, those opening too, so the daemon may evict it."""
        self._letting_go.add(name)
        try:
            opening = [f for k, f in self._opening.items() if k[0] == name]
            if opening:
                await asyncio.wait(opening)   # (their _opened ran first: it was added to each before)
            await self._close([k for k in self._open if k[0] == name])
        finally:
            self._letting_go.discard(name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._opening:
            await asyncio.wait(list(self._opening.values()))
        await self._close(list(self._open))
        await self._report()
        if self._client is not None:
            self._client.close()

    # -- in the background ---------------------------------------------------------------
    def _open_now(self, key: tuple[str, int]):
        """On an executor thread: the lease and the session (a round trip and ORT's session start), or None;
        the loop takes the outcome (_opened)."""
        from ..client.leases import LeaseClient
        from ..client.session import InferenceSession
        import onnxruntime as ort

        try:
            with self._client_lock:
                if self._client is None:
                    self._client = LeaseClient(self.socket, self.timeout_s, name=self.client_name)
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1   # the front's loop runs it; a pool thread would only add hand-offs
            so.inter_op_num_threads = 1
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            sess = InferenceSession(key[0], so, version=key[1], client=self._client)
        except Exception as e:
            log.info("%s@%s runs on the daemon: it could not be opened here: %s", *key, e)
            return None
        return sess

    def _opened(self, key: tuple[str, int], sess) -> None:
        del self._opening[key]
        if sess is None:
            self._refused[key] = self.clock()
            return
        self._open[key] = _Open(sess, self.clock())
        log.debug("%s@%s runs at the front", *key)

    async def _close(self, keys: list) -> None:
        """No request takes these sessions from now; they close off the loop (each a release round trip, after
        which the daemon may evict the model)."""
        closing = [self._open.pop(k) for k in keys if k in self._open]
        if closing:
            await asyncio.get_running_loop().run_in_executor(None, lambda: [h.sess.close() for h in closing])

    def _start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tend())

    async def _tend(self) -> None:
        """Once a second: report what ran here, and let go of what no request used for hold_s."""
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            try:
                now = self.clock()
                await self._close([k for k, held in self._open.items() if now - held.last > self.hold_s])
                await self._report()
            except Exception:   # (never the end of the reports: the next second tries again)
                log.exception("the front's sessions could not be tended")

    def _served_of(self, key: str) -> _Served:
        served = self._served.get(key)
        if served is None:
            served = self._served[key] = _Served()
        served.last_unix_ms = int(time.time() * 1e3)
        return served

    async def _report(self) -> None:
        """What ran or was answered here since the last report; also sent, empty, while this front holds cached
        answers, so that it hears when the daemon dropped its own under memory pressure and drops them too."""
        holding = self.answers is not None and self.answers.entries
        if not self._served and not holding:
            return
        served, self._served = self._served, {}
        try:
            reply = await self.link.call(P.FrontServed(req_id=0, models={k: s.wire() for k, s in served.items()}),
                                         (P.FrontServedReply, P.Ack))   # (Ack: an older daemon)
        except ModelCacheError as e:   # (the daemon is away: the counts wait for the next report)
            log.debug("report of requests run here not taken: %s", e)
            for k, s in served.items():
                self._served.setdefault(k, _Served()).absorb(s)
            return
        replacing = set(getattr(reply, "replacing", None) or ())   # (daemon/swaps.py: let go, so the swap may go on)
        if replacing:
            await self._close([k for k in self._open if f"{k[0]}@{k[1]}" in replacing])
        dropped = getattr(reply, "answers_dropped", None)
        if dropped is not None and self.answers is not None:
            if self._drops_seen is not None and dropped > self._drops_seen and self.answers.entries:
                freed = self.answers.clear()
                release_freed_heap()
                log.warning("memory pressure: the daemon dropped its cached answers; this front dropped its own, "
                            "%.1f MiB", freed / 2**20)
            self._drops_seen = dropped
