"""The systems benchmark's platform (benchmarks/systems/faas_platform.py) with real processes that stand in for
function instances: warm calls reuse an instance, the cap stops the least recently used idle one, the
keep-alive stops idle ones, a killed instance's call fails saying so; and the report's verdict."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from benchmarks.systems.faas_platform import Platform
from benchmarks.systems.run import verdict

# An instance: its first line once "loaded", then a line per call; "die" as the model's name kills it at load.
FAKE = """
import json, os, sys, time
if sys.argv[3] == "die":
    os.kill(os.getpid(), 9)
print(json.dumps({"start_ms": 1.0, "run_ms": 0.1, "hit": None, "pid": os.getpid()}), flush=True)
for _ in sys.stdin:
    time.sleep(float(os.environ.get("FAKE_RUN_S", "0")))
    print(json.dumps({"run_ms": 0.1, "pid": os.getpid()}), flush=True)
"""


def fake(argv):
    return [sys.executable, "-c", FAKE, *argv[2:]]   # (argv: python function.py SYSTEM PATH NAME)


def platform(keep_alive_s=60.0, max_instances=2, **env) -> Platform:
    return Platform("ort", fake, {**os.environ, **env}, keep_alive_s, max_instances, None, timeout_s=10)


def test_warm_calls_reuse_the_instance_and_the_cap_stops_the_least_recently_used():
    p = platform()
    try:
        a1 = p.call("a", "m", "a")
        a2 = p.call("a", "m", "a")
        assert a1["cold"] and not a2["cold"] and a1["pid"] == a2["pid"]
        b = p.call("b", "m", "b")
        c = p.call("c", "m", "c")               # third function, two slots: a (idle longest) is stopped for it
        assert b["cold"] and c["cold"] and p.started == 3 and p.stopped_for_room == 1 and p.live == 2
        assert not p.call("b", "m", "b")["cold"]
        assert p.call("a", "m", "a")["cold"]    # a's instance was the one stopped
    finally:
        p.close()


def test_the_keep_alive_stops_idle_instances():
    p = platform(keep_alive_s=0.3)
    try:
        first = p.call("a", "m", "a")
        time.sleep(1.2)
        assert p.stopped_idle == 1 and p.live == 0
        again = p.call("a", "m", "a")
        assert again["cold"] and again["pid"] != first["pid"]
    finally:
        p.close()


def test_a_killed_instance_fails_its_call_and_frees_its_slot():
    p = platform(max_instances=1)
    try:
        r = p.call("x", "m", "die")
        assert r["error"] == "instance killed by SIGKILL (the OOM killer)" and p.live == 0
        assert "error" not in p.call("a", "m", "a")
        pid = p.idle["a"][0].proc.pid
        os.kill(pid, signal.SIGKILL)
        assert p.call("a", "m", "a")["error"].startswith("instance killed by SIGKILL")
    finally:
        p.close()


def test_a_warm_instance_never_waits_behind_a_cold_start():
    """One slot, busy with a's call: b (needs a new instance) waits; a's next call, arriving after b, takes a's
    instance as soon as it is idle; b then stops it and starts its own."""
    p = platform(max_instances=1, FAKE_RUN_S="0.4")
    try:
        p.call("a", "m", "a")
        done = []

        def call(f):
            done.append((f, p.call(f, "m", f)))
        threads = [threading.Thread(target=call, args=(f,)) for f in ("a", "b", "a")]
        for t in threads:
            t.start()
            time.sleep(0.1)
        for t in threads:
            t.join()
        assert [(f, r["cold"]) for f, r in done] == [("a", False), ("a", False), ("b", True)], done
        assert p.stopped_for_room == 1
    finally:
        p.close()


def test_the_verdict_compares_the_best_of_each_side_at_each_budget():
    rows = [{"system": "mc-serve", "budget_gib": 1.0, "failed": 0, "oom_kills": 0, "p99_ms": 100.0, "gib_s": 10.0},
            {"system": "mc-attach", "budget_gib": 1.0, "failed": 3, "oom_kills": 0, "p99_ms": 50.0, "gib_s": 5.0},
            {"system": "triton", "budget_gib": 1.0, "failed": 0, "oom_kills": 0, "p99_ms": 400.0, "gib_s": 20.0},
            {"system": "ort", "budget_gib": 1.0, "failed": 9, "oom_kills": 2, "p99_ms": 90.0, "gib_s": 30.0}]
    [line] = verdict(rows)
    assert line.startswith("1 GiB: modelcache's best mc-serve p99 100 ms = 0.25x the best alternative's (triton")
    assert "memory-time 0.50x" in line and "mc-attach (3 failed, 0 OOM kills)" in line and "ort (9 failed, 2 OOM" in line
