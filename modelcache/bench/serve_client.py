"""One open-loop load generator process for `modelcache bench serve`.

    python -m modelcache.bench.serve_client '{"socket": ..., "model": ..., "rate": 20, ...}'

Sends one-sample requests at Poisson arrival times fixed in advance (seeded), whatever
the answers do: a request is sent at its scheduled time, or as soon after it as this
process can, and its latency counts from the scheduled time. So a backlog in the daemon
shows up as latency instead of slowing the sender (no coordinated omission).

Prints one JSON object: {"requests": [[scheduled_s, latency_s or null, error code or null,
samples in the batch that ran its last stage or null], ...],
"late_sends": how many went out >1 ms behind schedule}.
"""

from __future__ import annotations

import json
import os
import sys
import time


def run(cfg: dict) -> dict:
    import numpy as np

    from ..client.connection import connect
    from ..client.stream import InferStream
    from ..wire import tensors

    rng = np.random.default_rng(cfg["seed"])
    schedule, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / cfg["rate"])
        if t >= cfg["duration_s"]:
            break
        schedule.append(t)
    with connect(cfg["socket"]) as client, InferStream(client) as stream:
        described = client.describe(cfg["model"])
        group_of = cfg["socket"][len("ipc://"):] if cfg["socket"].startswith("ipc://") else None
        # One input, encoded once: a large one goes through one shm file that every request maps.
        wire, files = tensors.encode(tensors.random_feeds(described.inputs, batch=1, seed=cfg["seed"]),
                                     group_of=group_of)
        try:
            # Start together with the other generators: at the wall-clock time the parent chose.
            start = time.monotonic() + max(0.0, cfg["start_at"] - time.time())
            sent: dict[int, float] = {}
            results: dict[int, list] = {}
            late, i = 0, 0
            drain_until = start + cfg["duration_s"] + cfg["drain_s"]
            while i < len(schedule) or (sent and time.monotonic() < drain_until):
                now = time.monotonic()
                while i < len(schedule) and start + schedule[i] <= now:
                    late += now - (start + schedule[i]) > 1e-3
                    stream.send(i, cfg["model"], wire, deadline_ms=cfg.get("deadline_ms"))
                    sent[i] = start + schedule[i]
                    i += 1
                wait_s = (start + schedule[i] - now) if i < len(schedule) else (drain_until - now)
                for req_id, _, timings, error in stream.receive(max(0, int(wait_s * 1000))):
                    at = time.monotonic()
                    scheduled = sent.pop(req_id, None)
                    if scheduled is not None:
                        batch = timings["stages"][-1]["batch"] if timings.get("stages") else None
                        results[req_id] = [schedule[req_id], at - scheduled, getattr(error, "code", None), batch]
            for req_id in sent:  # never answered within the drain: a timeout
                results[req_id] = [schedule[req_id], None, "unanswered", None]
        finally:
            for f in files:
                os.unlink(f)
    return {"requests": [results[k] for k in sorted(results)], "late_sends": late}


def closed_loop(cfg: dict) -> dict:
    """cfg["threads"] threads, each with a serve session of its own, each running the model back to back
    from cfg["start_at"] (wall clock) for cfg["duration_s"]: {"requests": answered within that span}."""
    import threading

    import numpy as np  # noqa: F401  (the sessions' outputs)

    from ..client.session import InferenceSession
    from ..wire import tensors

    sessions = [InferenceSession(cfg["model"], mode="serve", socket=cfg["socket"]) for _ in range(cfg["threads"])]
    feeds = tensors.random_feeds(sessions[0]._inputs, batch=1, seed=cfg.get("seed", 0))
    sessions[0].run(None, feeds)
    start = time.monotonic() + max(0.0, cfg["start_at"] - time.time())
    end = start + cfg["duration_s"]
    counts = [0] * len(sessions)

    def loop(k: int) -> None:
        time.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < end:
            sessions[k].run(None, feeds)
            counts[k] += 1

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": sum(counts)}


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    print(json.dumps(closed_loop(cfg) if cfg.get("threads") else run(cfg)))
