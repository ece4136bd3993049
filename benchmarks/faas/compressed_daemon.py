"""A modelcache daemon whose eviction policies run on a trace compressed `--compress` times: what the
real-daemon replay (real_replay.py) starts, in place of `modelcache daemon`.

The daemon's clock stays the machine's (leases, heartbeats and deadlines are real seconds); only the
policies' windows shrink with the trace, as the simulated replay builds them (simulate.trace_policy):
keepalive's keep_alive_s, hybrid's bins, range and fallback. Settings come from the environment, as the
daemon reads them; prints READY when clients may connect.

    PYTHONPATH=. python -m benchmarks.faas.compressed_daemon --compress 15
"""

from __future__ import annotations

import argparse
import logging
import sys

from modelcache.config import load
from modelcache.daemon.server import run

from benchmarks.faas.simulate import trace_policy


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compress", type=float, required=True, help="trace time is divided by this")
    ap.add_argument("--log-level", default=None)
    args = ap.parse_args(argv)
    settings = load(overrides={"log_level": args.log_level})
    logging.basicConfig(level=settings.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def make_policy(settings, clock):
        return trace_policy(settings.eviction_policy, args.compress, settings.keep_alive_s)(clock)

    run(settings, on_ready=lambda: print(f"READY {settings.socket}", flush=True), make_policy=make_policy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
