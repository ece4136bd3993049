"""The tier stage's checks: every benchmarks/gpu/check_*.py run under its own limit, each leaving one JSON result.

    python3 benchmarks/gpu/checks.py run --out DIR [--budget SECONDS]     (verify.sh's `tier` step)

The contract a check keeps (a new one drops in beside the others, nothing else to change):
- it is `benchmarks/gpu/check_NAME.py`, run as `python3 check_NAME.py --out DIR` from the repository root,
  with PYTHONPATH = the repository + pyzmq and NO onnxruntime-gpu (the image's cupy-cuda13x, cuda-bindings
  and CPU onnxruntime 1.30), LD_LIBRARY_PATH = the image's nvidia/*/lib folders;
- it declares its time limit on a line of its own, `LIMIT_S = N` (read here without importing the file);
- it writes DIR/check_NAME.json: {"check": "NAME", "status": "ok" | "failed" | "error", "seconds": S,
  "figures": {KEY: value, ...}, "notes": ["...", ...], "error": "one line" or null}, best rewritten after
  each figure (`Result` below does), so that a check stopped at its limit keeps what it measured;
- it exits 0 when status is ok, 1 when it ran and something it checks does not hold, 2 when it could not
  run (no device, a module missing: "error" says which);
- it may take --rehearse: its flow here, without a GPU (the daemon's fake devices), less what needs one
  (benchmarks/tests run it so; the runner never passes it);
- it leaves nothing behind; at its limit the runner kills its process group (its daemon and children too)
  and marks the result "timeout", keeping the figures written so far; a check that wrote no JSON gets one
  with status "error" and the tail of its stderr.
report.py puts every DIR/check_*.json into report.json; targets.py reads the figures it knows by key.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_LIMIT_S = 60
_LIMIT = re.compile(r"^LIMIT_S\s*=\s*(\d+)\s*(#.*)?$", re.M)


class CheckFailed(Exception):
    """Something the check checks does not hold (exit 1)."""


class CannotRun(Exception):
    """The check cannot run here: no device, a missing module (exit 2)."""


class Result:
    """One check's JSON result, rewritten whenever a figure is set.

        with Result("ipc", out_dir) as r:
            r.set("lease_count", 2)
            r.require(ok, "what did not hold")     # records a failure, goes on
    """

    def __init__(self, name: str, out_dir: str | Path):
        self.path = Path(out_dir) / f"check_{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data = {"check": name, "status": "running", "seconds": 0.0, "figures": {}, "notes": [], "error": None}
        self.failures: list[str] = []
        self.rehearse = False          # --rehearse: the check's flow without a GPU (fake devices)
        self._t0 = time.monotonic()
        self.save()

    def set(self, key: str, value) -> None:
        self.data["figures"][key] = value
        self.save()

    def note(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self.data["notes"].append(text)
        self.save()

    def require(self, ok: bool, what: str) -> bool:
        """Record a failure when `ok` is false (the check goes on: later figures still count)."""
        if not ok:
            self.failures.append(what)
            self.note(f"FAILED: {what}")
        return ok

    def save(self) -> None:
        self.data["seconds"] = round(time.monotonic() - self._t0, 2)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    @property
    def exit_code(self) -> int:
        return {"ok": 0, "failed": 1}.get(self.data["status"], 2)

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, CheckFailed):
            if isinstance(exc, CheckFailed):
                self.failures.append(str(exc))
            self.data["status"] = "failed" if self.failures else "ok"
            self.data["error"] = "; ".join(self.failures) or None
        else:
            self.data["status"] = "error"
            self.data["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            if not isinstance(exc, CannotRun):
                self.data["notes"].append("".join(traceback.format_exception(kind, exc, tb))[-3000:])
        self.save()
        return not isinstance(exc, (KeyboardInterrupt, SystemExit)) if exc is not None else False


def main_for(name: str, body) -> int:
    """A check's main: parse --out (and --rehearse), run body(result), exit with the result's code."""
    ap = argparse.ArgumentParser(prog=f"check_{name}.py")
    ap.add_argument("--out", required=True, help="folder for check_NAME.json")
    ap.add_argument("--rehearse", action="store_true", help="here, without a GPU, where the check supports it: "
                                                            "its flow over fake devices, less what needs a GPU")
    args = ap.parse_args()
    with Result(name, args.out) as r:
        r.rehearse = args.rehearse
        if args.rehearse:
            r.set("rehearsal", True)
        body(r)
    print(json.dumps({"check": name, "status": r.data["status"], "error": r.data["error"]}))
    return r.exit_code


# -- the runner --------------------------------------------------------------------------------------

def discover(folder: Path = HERE) -> list[tuple[str, Path, int]]:
    """(name, path, limit_s) of every check_*.py, in name order."""
    out = []
    for path in sorted(folder.glob("check_*.py")):
        m = _LIMIT.search(path.read_text())
        out.append((path.stem.removeprefix("check_"), path, int(m.group(1)) if m else DEFAULT_LIMIT_S))
    return out


def _finish(out: Path, name: str, status: str | None, why: str) -> dict:
    """The check's result as it left it, with the runner's verdict where the check could not give one."""
    path = out / f"check_{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"check": name, "figures": {}, "notes": [], "error": None}
        status = status or "error"
    if status:
        data["status"], data["error"] = status, why
    path.write_text(json.dumps(data, indent=1))
    return data


def run_all(out: Path, budget_s: float, folder: Path = HERE, log=print) -> dict[str, dict]:
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + budget_s
    results = {}
    for name, path, limit in discover(folder):
        left = t_end - time.monotonic()
        limit = min(limit, left)
        if limit < 10:
            earlier = out / f"check_{name}.json"      # a run before this one keeps its result
            results[name] = json.loads(earlier.read_text()) if earlier.exists() else \
                _finish(out, name, "skipped", f"{left:.0f} s left of the checks' budget")
            log(f"check {name}: not run, {left:.0f} s left" + (" (its earlier result stands)" if earlier.exists()
                                                                else ""))
            continue
        t0 = time.monotonic()
        with open(out / f"check_{name}.log", "wb") as logf:
            proc = subprocess.Popen([sys.executable, str(path), "--out", str(out)], stdout=logf, stderr=logf,
                                    start_new_session=True)    # its own process group: killed whole at the limit
            try:
                rc, status, why = proc.wait(timeout=limit), None, ""
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc, status, why = None, "timeout", f"stopped at its limit of {limit:.0f} s"
        if status is None and not (out / f"check_{name}.json").exists():
            tail = (out / f"check_{name}.log").read_text(errors="replace").strip().splitlines()[-3:]
            status, why = "error", f"rc {rc}, no result written: " + " | ".join(tail)
        results[name] = _finish(out, name, status, why)
        if status is None and results[name].get("status") == "running":   # exited without closing its Result
            results[name] = _finish(out, name, "error", f"rc {rc}: exited before finishing its result")
        log(f"check {name}: {results[name]['status']} in {time.monotonic() - t0:.0f} s"
            + (f" ({results[name]['error']})" if results[name].get("error") else ""))
    return results


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every check_*.py, one after the other")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--budget", type=float, default=300, help="seconds for all of them")
    sub.add_parser("list", help="the checks and their limits")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for name, path, limit in discover():
            print(f"{name}: {path.name}, limit {limit} s")
        return 0
    results = run_all(args.out, args.budget)
    return 0 if all(r.get("status") == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
