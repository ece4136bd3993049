"""Does mapping the weights' pages on another thread while ORT builds the session (session_options.prefault)
shorten a fresh attach client's cold start? Fresh processes, prefault off and on, alternating round by round.

    PYTHONPATH=. python benchmarks/coldstart/prefault/prefault_ab.py [--models alexnet vgg16] [--runs 9]

Each sample is bench/coldstart_child.py in attach-hit mode (exec to first result, with its phases), the
model resident in a private daemon's host tier; MODELCACHE_PREFAULT=0 turns the thread off. Prints per
model the median of each side, the paired ratio on/off per round (median [min-max]), and the phases.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from modelcache.bench.coldstart import prepare_tuned, sample
from modelcache.bench.common import compile_bytecode, ensure_models, managed_daemon, summary
from modelcache.client.connection import connect


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["alexnet", "vgg16"])
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    compile_bytecode()
    rows = []
    with tempfile.TemporaryDirectory(prefix="modelcache-prefault-") as tmp, \
            tempfile.TemporaryDirectory(prefix="modelcache-prefault-", dir="/dev/shm") as shm:
        socket = f"ipc://{tmp}/daemon.sock"
        with managed_daemon(socket, f"{tmp}/repo"):
            paths = ensure_models(socket, args.models, Path(tmp) / "zoo")
            with connect(socket) as client:
                tuned = {n: prepare_tuned(client, n, Path(shm)) for n in args.models}
                for n in args.models:
                    client.release(client.open(n).lease_id)
            for r in range(args.runs):
                for name in args.models:
                    for on in ((0, 1) if r % 2 == 0 else (1, 0)):   # alternate which goes first
                        os.environ["MODELCACHE_PREFAULT"] = str(on)
                        s = sample("attach-hit", name, paths[name], tuned[name], socket)
                        rows.append({**s, "prefault": on, "run": r})
                print(f"round {r + 1}/{args.runs}", file=sys.stderr, flush=True)
    os.environ.pop("MODELCACHE_PREFAULT", None)
    print(f"{'model':<10} {'prefault':>8} {'total ms':>24} {'session':>8} {'1st run':>8}")
    for name in args.models:
        for on in (0, 1):
            rs = [x for x in rows if x["model"] == name and x["prefault"] == on]
            print(f"{name:<10} {'on' if on else 'off':>8} {summary([x['total_ms'] for x in rs]):>24} "
                  f"{statistics.median(x['session_ms'] for x in rs):>8.1f} "
                  f"{statistics.median(x['first_run_ms'] for x in rs):>8.1f}")
        total = {(x["prefault"], x["run"]): x["total_ms"] for x in rows if x["model"] == name}
        first = {(x["prefault"], x["run"]): x["session_ms"] + x["first_run_ms"] for x in rows if x["model"] == name}
        print(f"{name:<10} on/off paired by round: total {summary([total[1, r] / total[0, r] for r in range(args.runs)], '.3f')}, "
              f"session + first run {summary([first[1, r] / first[0, r] for r in range(args.runs)], '.3f')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
