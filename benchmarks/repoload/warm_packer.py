"""Packs forked from a warm server (modelcache/store/warm_packer.py) against packs in a fresh interpreter.

    python benchmarks/repoload/warm_packer.py [--models tiny-cnn squeezenet1_1 resnet50] [--rounds 5]
        [--import-models 12] [--baseline CHECKOUT] [--out benchmarks/repoload]

1. One pack, timed from the call to its manifest, with `pack_in_subprocess` as the daemon calls it, three ways in
   each round, the order rotated round by round: `exec` (a fresh `python -m modelcache.store.packing`, every pack
   before this change), `warm` (forked by a server that packed before), `first` (the first pack of a server just
   made: it waits for the server's imports). Then the server's memory, idle after its packs (psutil: USS, PSS).
2. With --baseline: `modelcache import-triton` of a Triton repository of N small models (SqueezeNet 1.1 under N
   names), timed to the end of the command, into a fresh daemon of this checkout and one of CHECKOUT (before the
   warm packer), alternated round by round.
Medians [min-max] over rounds; ratios per round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WAYS = ("exec", "warm", "first")


def one_pack(way: str, src: str, repo: Path, name: str, version: int, warm) -> float:
    from modelcache.store.packing import pack_in_subprocess
    from modelcache.store.warm_packer import WarmPacker
    fresh = WarmPacker() if way == "first" else None
    spawn = {"exec": None, "warm": warm.spawn, "first": fresh.spawn if fresh else None}[way]
    try:
        t0 = time.perf_counter()
        pack_in_subprocess(src, repo, name, version, **({"spawn": spawn} if spawn else {}))
        return time.perf_counter() - t0
    finally:
        if fresh is not None:
            fresh.stop()


def packs(models: list[str], rounds: int, work: Path, log) -> tuple[list[dict], dict]:
    import psutil
    from modelcache import zoo
    from modelcache.store.warm_packer import WarmPacker
    rows = []
    warm = WarmPacker()
    try:
        for model in models:
            src = str(work / f"{model}.onnx")
            zoo.save(zoo.build(model), src)
            repo = work / f"repo-{model}"
            one_pack("warm", src, repo, "warmup", 1, warm)   # the server up, its imports done
            for r in range(rounds):
                order = WAYS[r % 3:] + WAYS[:r % 3]
                for way in order:
                    s = one_pack(way, src, repo, f"{way}-{r}", 1, warm)
                    rows.append({"model": model, "round": r, "way": way, "s": s})
                log(f"{model} round {r + 1}/{rounds}: " + ", ".join(f"{x['way']} {x['s']:.2f} s" for x in rows
                                                                  if x["model"] == model and x["round"] == r))
        time.sleep(0.5)
        m = psutil.Process(warm.pid).memory_full_info()
        memory = {"uss_mib": m.uss / 2**20, "pss_mib": m.pss / 2**20, "rss_mib": m.rss / 2**20}
    finally:
        warm.stop()
    return rows, memory


def imports(n: int, rounds: int, baseline: str, work: Path, log) -> list[dict]:
    from modelcache import zoo
    from modelcache.measure import managed_daemon
    src = work / "squeezenet1_1.onnx"
    if not src.exists():
        zoo.save(zoo.build("squeezenet1_1"), str(src))
    triton = work / "triton"
    for i in range(n):
        d = triton / f"sq{i}" / "1"
        d.mkdir(parents=True, exist_ok=True)
        if not (d / "model.onnx").exists():
            (d / "model.onnx").symlink_to(src)
        (triton / f"sq{i}" / "config.pbtxt").write_text(f'name: "sq{i}"\nbackend: "onnxruntime"\n')
    rows = []
    for r in range(rounds):
        for label, checkout in (("this", ROOT), ("baseline", Path(baseline)))[::1 if r % 2 == 0 else -1]:
            home = work / f"{label}-{r}"
            home.mkdir()
            code = {"PYTHONPATH": str(checkout.resolve()), "PYTHONSAFEPATH": "1", "MODELCACHE_CONFIG": ""}
            socket = f"ipc://{home}/d.sock"
            with managed_daemon(socket, str(home / "repo"), env=code):
                env = {**os.environ, **code, "MODELCACHE_SOCKET": socket, "MODELCACHE_REPOSITORY": str(home / "repo")}
                t0 = time.perf_counter()
                out = subprocess.run([sys.executable, "-m", "modelcache.cli", "import-triton", str(triton)], env=env,
                                     capture_output=True, text=True, cwd=home)
                s = time.perf_counter() - t0
                if out.returncode != 0 or f"{n} versions imported" not in out.stdout:
                    raise SystemExit(f"import into {label} failed: {out.stdout[-800:]} {out.stderr[-800:]}")
            rows.append({"checkout": label, "round": r, "s": s})
            log(f"import of {n} models, round {r + 1}/{rounds}, {label}: {s:.2f} s")
    return rows


def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def report(pack_rows, memory, import_rows, n, baseline) -> str:
    rounds = max(r["round"] for r in pack_rows) + 1
    lines = [f"one pack, pack_in_subprocess as the daemon calls it, {rounds} rounds (ways rotated); seconds",
             f"  {'model':<16}" + "".join(f"{w:>22}" for w in WAYS) + f"{'warm / exec, per round':>30}"]
    for model in dict.fromkeys(r["model"] for r in pack_rows):
        by = {w: {r["round"]: r["s"] for r in pack_rows if r["model"] == model and r["way"] == w} for w in WAYS}
        ratio = [by["warm"][k] / by["exec"][k] for k in by["exec"]]
        lines.append(f"  {model:<16}" + "".join(f"{med(list(by[w].values())):>22}" for w in WAYS) + f"{med(ratio):>30}")
    lines.append(f"the server, idle after its packs: USS {memory['uss_mib']:.1f} MiB, PSS {memory['pss_mib']:.1f} MiB, "
                 f"RSS {memory['rss_mib']:.1f} MiB")
    if import_rows:
        by = {c: {r["round"]: r["s"] for r in import_rows if r["checkout"] == c} for c in ("this", "baseline")}
        ratio = [by["this"][k] / by["baseline"][k] for k in by["this"]]
        rev = lambda path: subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],  # noqa: E731
                                          capture_output=True, text=True).stdout.strip() or "?"
        lines.append(f"modelcache import-triton of {n} SqueezeNet 1.1 models into a fresh daemon, seconds: this checkout "
                     f"({rev(ROOT)}) {med(list(by['this'].values()))}, {baseline} ({rev(baseline)}) "
                     f"{med(list(by['baseline'].values()))}; this / baseline per round {med(ratio)}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-cnn", "squeezenet1_1", "resnet50"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--import-models", type=int, default=12)
    ap.add_argument("--baseline", help="a checkout before the warm packer, for the import-triton comparison")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    from modelcache.measure import compile_bytecode
    compile_bytecode()
    with tempfile.TemporaryDirectory(prefix="mc-warmpack-") as tmp:
        work = Path(tmp)
        pack_rows, memory = packs(args.models, args.rounds, work, log)
        import_rows = imports(args.import_models, args.rounds, args.baseline, work, log) if args.baseline else []
    text = report(pack_rows, memory, import_rows, args.import_models, args.baseline)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        given = sys.argv[1:] if argv is None else list(argv)
        (out / "warm_packer.txt").write_text(f"$ python benchmarks/repoload/warm_packer.py {' '.join(given)}\n"
                                             f"(load average {os.getloadavg()[0]:.2f} at the end)\n" + text)
        (out / "warm_packer.json").write_text(json.dumps({"packs": pack_rows, "server_memory": memory,
                                                          "imports": import_rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
