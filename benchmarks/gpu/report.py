"""verify.sh's report: each step's outcome and everything the steps wrote, gathered into one folder.

    python3 report.py step STATE NAME STATUS RC SECONDS CAP [WHY]   record how a step ended
    python3 report.py status STATE NAME                             print how it ended ("not run" if it did not)
    python3 report.py collect STATE REPORT_DIR                      write REPORT_DIR/report.json, report.md,
                                                                    junit-*.xml and logs.tar.gz

Standard library only (it runs before anything is installed, and after a step that broke the install).
REPORT_DIR is $OUT/gpu-report: the device tool brings back a few files, two folders down, so the raw logs,
the checks' results and the benchmark's own outputs travel as one tarball besides report.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan import ORDER  # noqa: E402
from targets import evaluate, table  # noqa: E402

JUNIT = {"tier": "junit-tier.xml", "ort": "junit-ort.xml"}


def record_step(state: Path, name: str, status: str, rc: int, seconds: int, cap: int, why: str = "") -> None:
    (state / "steps").mkdir(parents=True, exist_ok=True)
    (state / "steps" / f"{name}.json").write_text(json.dumps(
        {"status": status, "rc": rc, "seconds": seconds, "limit_s": cap, "log": f"logs/{name}.log", "why": why,
         "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))


def step_status(state: Path, name: str) -> str:
    s = load(state / "steps" / f"{name}.json")
    return s["status"] if s else "not run"


def junit_summary(path: Path) -> dict | None:
    """Counts and names from pytest's junit xml (per test case: a failure, an error, a skip, or a pass)."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:   # a run killed while writing it
        return {"passed": 0, "failed": 0, "errors": 1, "skipped": 0, "failures": [f"junit xml unreadable: {e}"],
                "skips": []}
    out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if "failure" in kinds or "error" in kinds:
            out["failed" if "failure" in kinds else "errors"] += 1
            out["failures"].append(name)
        elif "skipped" in kinds:
            out["skipped"] += 1
            out["skips"].append(f"{name}: {case.find('skipped').get('message', '')}")
        else:
            out["passed"] += 1
    return out


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def gather(state: Path) -> dict:
    kit = sorted((state / "files").glob("ort-kit-*.json"))
    report = {"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "steps": {p.stem: load(p) for p in sorted((state / "steps").glob("*.json"))},
              "device": load(state / "device.json"),
              "tests": {k: junit_summary(state / name) for k, name in JUNIT.items()},
              "checks": {p.stem.removeprefix("check_"): load(p) for p in sorted((state / "checks").glob("check_*.json"))},
              "kit": {"built": load(kit[-1]) if kit else None, "unpack": load(state / "kit-unpack.json")},
              "dropin": load(state / "dropin.json"),
              "bench": {p.parent.name: load(p) for p in sorted((state / "bench").glob("*/results.json"))}}
    report["figures"] = evaluate(report)
    return report


def device_line(device: dict | None) -> str:
    if not device:
        return "device: not probed (the probe step did not run)"
    gpus = (device.get("nvidia_smi") or {}).get("gpus") or [{}]
    g = gpus[0]
    ort = device.get("onnxruntime") or {}
    return (f"device: {g.get('name', '?')} ({g.get('memory.total', '?')}), driver {g.get('driver_version', '?')}, "
            f"CUDA {(device.get('nvidia_smi') or {}).get('cuda_driver_api', '?')}; onnxruntime "
            f"{ort.get('version', ort.get('error', '?'))}, session providers "
            f"{(ort.get('session') or {}).get('providers', '?')}; python {device.get('python', '?')}")


def fallback_line(report: dict) -> str | None:
    """Said at the top when the compacted CUDA provider did not run: what the session has instead."""
    verdict = (report.get("device") or {}).get("cuda_ep")
    if verdict and not verdict.get("ok"):
        return f"**FALLBACK**: {verdict.get('why')}: {verdict.get('fallback')}."
    return None


def markdown(report: dict) -> str:
    lines = ["# GPU tier verification (benchmarks/gpu/verify.sh)", "", device_line(report["device"]),
             f"written {report['written']}"]
    if fallback := fallback_line(report):
        lines += ["", fallback]
    lines += ["", "## Steps", "", "| step | status | seconds | limit s | why |", "|---|---|---|---|---|"]
    for name in ORDER:
        s = report["steps"].get(name)
        lines.append(f"| {name} | {s['status']} (rc {s['rc']}) | {s['seconds']} | {s['limit_s']} | {s.get('why') or ''} |"
                     if s else f"| {name} | not run | - | - | |")
    for which, t in (report.get("tests") or {}).items():
        if t:
            lines += ["", f"## Tests ({JUNIT[which]})", "",
                      f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"]
            lines += [f"- failed: {n}" for n in t["failures"]] + [f"- skipped: {n}" for n in t["skips"]]
    if report.get("checks"):
        lines += ["", "## Checks (check_*.py)", "", "| check | status | seconds | error |", "|---|---|---|---|"]
        for name, c in report["checks"].items():
            c = c or {}
            lines.append(f"| {name} | {c.get('status')} | {c.get('seconds', '-')} | {c.get('error') or ''} |")
    lines += ["", "## Figures (issue #36, steps 1 and 2)", "", table(report["figures"]), ""]
    return "\n".join(lines)


def collect(state: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    report = gather(state)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    for name in JUNIT.values():
        if (state / name).exists():
            shutil.copyfile(state / name, out / name)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for folder in ("logs", "bench", "steps", "checks"):
            if (state / folder).exists():
                tar.add(state / folder, arcname=folder)
        for name in ("device.json", "dropin.json", "kit-unpack.json"):
            if (state / name).exists():
                tar.add(state / name, arcname=name)
    return report


def main(argv: list[str]) -> int:
    if len(argv) in (7, 8) and argv[0] == "step":
        record_step(Path(argv[1]), argv[2], argv[3], int(argv[4]), int(argv[5]), int(argv[6]),
                    argv[7] if len(argv) == 8 else "")
    elif len(argv) == 3 and argv[0] == "status":
        print(step_status(Path(argv[1]), argv[2]))
    elif len(argv) == 3 and argv[0] == "collect":
        print(markdown(collect(Path(argv[1]), Path(argv[2]))))
    else:
        print("usage: report.py step STATE NAME STATUS RC SECONDS CAP [WHY] | status STATE NAME | "
              "collect STATE REPORT_DIR", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
