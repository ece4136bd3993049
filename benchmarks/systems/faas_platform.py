"""The FaaS platform the process-per-instance systems run under, as OpenWhisk or Azure Functions runs
functions: a call goes to an idle warm instance of its function if there is one, else a new instance (a
fresh process: the cold start) is started for it. An instance idle for the keep-alive is stopped (Azure's
fixed 10 minutes, compressed with the trace). At most `max_instances` live at once: a call that needs a new
instance when all slots are taken stops the least recently used idle instance of another function, or waits
for one to become idle (in arrival order).

Which system a function runs is the instance's program only (function.py SYSTEM): modelcache attach, ORT's
mmap and plain ORT run under the very same platform.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

FUNCTION = str(Path(__file__).with_name("function.py"))


class Instance:
    """A function instance's process and the pipe it answers on."""

    def __init__(self, argv: list[str], env: dict, log):
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                     text=True, bufsize=1)
        self.idle_since = 0.0

    def answer(self, timeout_s: float) -> dict:
        """The instance's next line, or an error that says why there is none (a timeout, a kill)."""
        if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
            self.stop()
            return {"error": f"timeout: no answer in {timeout_s:.0f} s"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            what = "killed by SIGKILL (the OOM killer)" if code == -signal.SIGKILL else f"exited with status {code}"
            return {"error": f"instance {what}"}
        return json.loads(line)

    def call(self, timeout_s: float) -> dict:
        try:
            self.proc.stdin.write("run\n")
            self.proc.stdin.flush()
        except OSError:
            pass                    # (dead: answer() says how it ended)
        return self.answer(timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Platform:
    """`call(function, model_path, name)` from many threads; `close()` stops every instance."""

    def __init__(self, system: str, wrap, env: dict, keep_alive_s: float, max_instances: int, log,
                 timeout_s: float = 60.0):
        self.system, self.wrap, self.env, self.log = system, wrap, env, log
        self.keep_alive_s, self.max_instances, self.timeout_s = keep_alive_s, max_instances, timeout_s
        self.idle: dict[str, list[Instance]] = {}   # function -> its idle instances, most recently used last
        self.live = 0                               # instances started and not stopped (idle or busy)
        self.started = self.stopped_idle = self.stopped_for_room = 0
        self.cond = threading.Condition()
        self.queue: deque = deque()                 # calls waiting for a slot, in arrival order
        self.closed = False
        self.reaper = threading.Thread(target=self._reap, daemon=True)
        self.reaper.start()

    def call(self, function: str, path: str, name: str) -> dict:
        asked = time.monotonic()
        instance, cold = self._take(function)
        waited_ms = (time.monotonic() - asked) * 1e3       # for a slot: the platform's queue, not the system
        if instance is None:
            instance = Instance(self.wrap([sys.executable, FUNCTION, self.system, path, name]), self.env, self.log)
            with self.cond:
                self.started += 1
            r = instance.answer(self.timeout_s)
        else:
            r = instance.call(self.timeout_s)
        r.update(cold=cold, wait_ms=waited_ms)
        with self.cond:
            if "error" in r or self.closed:
                instance.stop()
                self.live -= 1
            else:
                instance.idle_since = time.monotonic()
                self.idle.setdefault(function, []).append(instance)
            self.cond.notify_all()
        return r

    def _take(self, function: str) -> tuple[Instance | None, bool]:
        """A warm idle instance of `function` (False: warm), or a slot for a new one (None, True)."""
        ticket = (object(), function)
        with self.cond:
            self.queue.append(ticket)
            while True:
                if self.queue[0] is ticket:
                    mine = self.idle.get(function)
                    if mine:
                        self.queue.popleft()
                        self.cond.notify_all()
                        return mine.pop(), False
                    waiting = {fn for _, fn in self.queue}
                    if self.live < self.max_instances or self._stop_lru_idle(spare=waiting):
                        self.live += 1
                        self.queue.popleft()
                        self.cond.notify_all()
                        return None, True
                elif self.idle.get(function):   # a warm instance never waits behind cold starts
                    self.queue.remove(ticket)
                    self.cond.notify_all()
                    return self.idle[function].pop(), False
                self.cond.wait()

    def _stop_lru_idle(self, spare: set) -> bool:
        """Stop the idle instance idle longest (under the lock), freeing its slot; never one of a function in
        `spare` (a call of it waits: that instance is its warm start)."""
        oldest = min((fn for fn, xs in self.idle.items() if xs and fn not in spare),
                     key=lambda fn: self.idle[fn][0].idle_since, default=None)
        if oldest is None:
            return False
        self.idle[oldest].pop(0).stop()
        self.live -= 1
        self.stopped_for_room += 1
        return True

    def _reap(self) -> None:
        while True:
            time.sleep(min(0.5, self.keep_alive_s / 4))
            with self.cond:
                if self.closed:
                    return
                now = time.monotonic()
                for xs in self.idle.values():
                    while xs and now - xs[0].idle_since > self.keep_alive_s:
                        xs.pop(0).stop()
                        self.live -= 1
                        self.stopped_idle += 1
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for xs in self.idle.values():
                for x in xs:
                    x.stop()
            self.idle.clear()
