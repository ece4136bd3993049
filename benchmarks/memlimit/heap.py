"""The daemon's own memory while it serves many models in turn: what its serve sessions leave resident.

Inside a memory limit the daemon's own anonymous memory counts beside the host tier: every MiB of it is a MiB
no model can use (docs/tiers.md, "Inside a memory limit"). Serving many models through a tier that holds a few
builds and drops a model's stage sessions at every promotion; what glibc keeps of their freed arenas and
buffers stays resident. This serves each model once, in turn, `--rounds` times, through a `--capacity` tier,
and reads the daemon's anonymous memory (smaps_rollup) before and after each round, for each checkout given,
the checkouts alternated run by run:

    PYTHONPATH=. python benchmarks/memlimit/heap.py --checkouts /tmp/base . --out benchmarks/memlimit

Each function copy of a zoo model has weights of its own (benchmarks/systems' copies, built once in --work).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

MiB = 1 << 20
MODELS = ",".join([f"resnet50#{i}" for i in range(4)] + [f"googlenet#{i}" for i in range(4)]
                  + [f"squeezenet1_1#{i}" for i in range(4)] + ["vit_b_16#0", "vit_b_16#1", "tiny-cnn#0"])


def revision(checkout: str) -> str:
    """The checkout's commit, and whether its tree differs from it: what a row of the table ran."""
    import subprocess
    git = ["git", "-C", checkout]
    rev = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no", "--", "modelcache"],
                           capture_output=True, text=True).stdout.strip()
    return (rev or "not a git checkout") + (" + uncommitted changes to modelcache/" if dirty else "")


def one_run(checkout: str, repo: Path, names: list[str], capacity: str, rounds: int) -> dict:
    """A fresh daemon from `checkout` over `repo`: its anonymous MiB idle, then after each round."""
    from modelcache.bench.coldstart_child import ones_feeds
    from modelcache.client.connection import connect
    from modelcache.client.serve import ServeSession
    from modelcache.measure import managed_daemon, memory_mib
    env = {"MODELCACHE_HOST_CAPACITY": capacity, "PYTHONPATH": str(Path(checkout).resolve()), "PYTHONSAFEPATH": "1"}
    with tempfile.TemporaryDirectory(prefix="mc-heap-") as tmp, \
            managed_daemon(f"ipc://{tmp}/d.sock", str(repo), env=env) as sock, connect(sock) as c:
        pid = c.stats().pid
        out = {"idle_mib": memory_mib(pid)["anon_mib"], "rounds_mib": []}
        for _ in range(rounds):
            for name in names:
                s = ServeSession(name, client=c)
                s.run(None, ones_feeds(s, np))
            out["rounds_mib"].append(memory_mib(pid)["anon_mib"])
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--checkouts", nargs="+", default=["."], help="each a checkout whose daemon runs (default: .)")
    ap.add_argument("--models", default=MODELS, help="zoo models, ARCH#COPY, comma-separated (default: %(default)s)")
    ap.add_argument("--capacity", default="512M", help="the host tier (default %(default)s: a few models fit)")
    ap.add_argument("--rounds", type=int, default=2, help="each model served once a round (default 2)")
    ap.add_argument("--runs", type=int, default=3, help="fresh daemons per checkout, alternated (default 3)")
    ap.add_argument("--work", default="/tmp/mc-heap", help="the models and repository, kept (default %(default)s)")
    ap.add_argument("--out", help="a folder for heap.txt and heap.json")
    args = ap.parse_args(argv)
    from benchmarks.systems.run import add_to_repository, build_models, name_of
    from modelcache.measure import summary
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    work = Path(args.work)
    paths = build_models(keys, work / "models", False, print)
    add_to_repository(work / "repo", paths, print)
    names = [name_of(k) for k in sorted(keys)]
    results = {c: [] for c in args.checkouts}
    for run in range(args.runs):
        for checkout in args.checkouts:
            r = one_run(checkout, work / "repo", names, args.capacity, args.rounds)
            results[checkout].append(r)
            print(f"run {run + 1}, {checkout}: idle {r['idle_mib']:.0f} MiB, after each round "
                  + ", ".join(f"{m:.0f}" for m in r["rounds_mib"]) + " MiB", flush=True)
    lines = [f"$ python benchmarks/memlimit/heap.py {' '.join(sys.argv[1:] if argv is None else argv)}",
             f"{len(names)} models ({args.models}), host tier {args.capacity}, {args.rounds} rounds, {args.runs} runs "
             "per checkout, alternated; the daemon's anonymous memory (smaps_rollup), MiB:",
             "| checkout | idle | after the last round, median [min-max] |", "|---|---|---|"]
    for checkout, runs in results.items():
        last = [r["rounds_mib"][-1] for r in runs]
        lines.append(f"| {checkout} ({revision(checkout)}) | {summary([r['idle_mib'] for r in runs], '.0f')} | "
                     f"{summary(last, '.0f')} |")
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "heap.txt").write_text("\n".join(lines) + "\n")
        (out / "heap.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
