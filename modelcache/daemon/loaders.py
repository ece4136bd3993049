"""Slow work off the owner loop: loader threads run it, the owner loop applies what it returns.

Loader threads never touch the daemon's tables: `run(work, done)` runs `work()` on a thread and
queues `done(result, error)`, which the owner loop calls in `apply_completions` (after `wake`
pokes it). The executor posts its completions through the same queue (`post`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import traceback

from ..errors import ModelCacheError

log = logging.getLogger("modelcache.daemon")


class Loaders:
    def __init__(self, threads: int, wake=lambda: None):
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="loader")
        self.completions: queue.Queue = queue.Queue()
        self.wake = wake                  # () -> None, from any thread: the owner loop should look
        self.pending: list = []           # (future, done) of tasks, to answer them at stop

    def post(self, done, result, error) -> None:
        """From any thread: have `done(result, error)` run on the owner loop, and wake it."""
        self.completions.put((done, result, error))
        self.wake()

    def run(self, work, done) -> None:
        """Run `work` on a loader thread; `done(result, error)` runs later on the owner loop."""
        def task():
            try:
                result, error = work(), None
            except ModelCacheError as e:
                result, error = None, e
            except Exception as e:
                log.error("loader task failed: %s", traceback.format_exc())
                result, error = None, ModelCacheError(f"{type(e).__name__}: {e}")
            self.post(done, result, error)
        self.pending = [(f, d) for f, d in self.pending if not f.done()]
        self.pending.append((self.pool.submit(task), done))

    def apply_completions(self) -> None:
        """On the owner loop: call every queued `done`."""
        while True:
            try:
                done, result, error = self.completions.get_nowait()
            except queue.Empty:
                return
            try:
                done(result, error)
            except Exception:  # a bug in one completion must not take the daemon (and every client) down
                log.error("internal error in a completion: %s", traceback.format_exc())

    def settle(self) -> None:
        """Wait for every task started so far and apply what it returned (the tasks' completions may start
        more: those are waited for too). For tests that step the daemon's parts by hand."""
        while True:
            running = [f for f, _ in self.pending if not f.done()]
            if not running and self.completions.empty():
                return
            concurrent.futures.wait(running)
            self.apply_completions()

    def shutdown(self) -> None:
        """Finish running tasks, drop queued ones, and answer every caller: queued ones with "stopping"."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.apply_completions()
        stopping = ModelCacheError("the modelcache daemon is stopping")
        for future, done in self.pending:
            if future.cancelled():  # queued, never started: its caller still deserves an answer
                done(None, stopping)
