"""Prepare what a GPU session must carry to the device machine, and print the run calls to make.

    python benchmarks/gpu/prepare.py [--package NAME==VERSION ...] [--margin-mib 2] [--no-check]

Run it in the checkout that the session was started in (the device tool sends that one). It
1. gets the wheels the GPU image lacks (shared/GPU.md: onnxruntime-gpu, a CUDA 13 build, and pyzmq; the
   rest -- numpy, onnx, msgpack, psutil, xxhash, cupy-cuda13x, the CUDA libraries -- is in the image) with
   `pip download` from the configured index and find-links into .gpukit-wheels/ (kept: a second run
   downloads nothing);
2. measures what travels with every call anyway (tracked and untracked-not-ignored files, shared/), and
   cuts the wheels into parts that fit beside it under the 64 MiB a call carries, one folder per call:
   .gpukit/call1, call2, ... each with manifest.json (sha256 of every whole file and every part);
3. checks the kit by staging and reassembling it as the device will (chunks.py), and
4. prints the sequence of `run` calls (command, carry, timeout), also written to .gpukit/RUNS.md.
The project itself needs no wheel: the working tree travels, and verify.sh puts it first on PYTHONPATH.
Both folders are git-ignored: nothing here goes into a commit.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chunks import KitError, assemble, split, stage  # noqa: E402  (beside this script; stdlib only)

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpukit"
WHEELS = ROOT / ".gpukit-wheels"
CARRY_LIMIT = 64 * 2**20          # the device tool's working tree + carried paths, per call
PACKAGES = ["onnxruntime-gpu==1.31.1", "pyzmq==27.3.0"]
# The GPU image's python3 is CPython 3.12 on x86-64 (its pip accepts manylinux wheels up to glibc 2.39).
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p)]
# Each step's budget (seconds) and what the calls run: verify.sh's steps, in the order of a session.
STAGE_TIMEOUT_S = 120
FULL_TIMEOUT_S = 600
AFTER_KIT = [("bash benchmarks/gpu/verify.sh tests bench-vgg16", FULL_TIMEOUT_S),
             ("bash benchmarks/gpu/verify.sh bench-rest", FULL_TIMEOUT_S)]


def wheel_for(requirement: str, folder: Path) -> Path | None:
    """The wheel of NAME==VERSION in `folder` (wheel names normalize '-' to '_'), if there is one."""
    name, _, version = requirement.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [p for p in folder.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-")]
    return sorted(found)[-1] if found else None


def fetch(requirements: list[str], folder: Path) -> list[Path]:
    """One wheel per requirement: downloaded by pip (index, find-links), or the copy already in `folder`."""
    folder.mkdir(exist_ok=True)
    wheels = []
    for req in requirements:
        if "==" not in req:
            raise KitError(f"{req}: pin each package (NAME==VERSION): two versions of one package stop the install")
        have = wheel_for(req, folder)
        if have is None:
            print(f"downloading {req} ...", file=sys.stderr, flush=True)
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", *PLATFORM, "-d", str(folder), req],
                               capture_output=True, text=True)
            have = wheel_for(req, folder)
            if have is None:
                raise KitError(f"{req}: pip download found no wheel for CPython 3.12 manylinux x86-64 and none is in "
                               f"{folder} ({(r.stderr.strip().splitlines() or ['no message'])[-1]}); put the wheel "
                               "there by hand, or pick a version the index has (pip index versions NAME)")
        print(f"{have.name}: {have.stat().st_size / 2**20:.1f} MiB", file=sys.stderr)
        wheels.append(have)
    return wheels


def travelling_bytes(root: Path) -> int:
    """What every call sends besides the carried paths: tracked and untracked-not-ignored files, and shared/."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    files = {root / n for n in names if n}
    if (root / "shared").is_dir():
        files |= {p for p in (root / "shared").rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def run_calls(calls: int) -> list[tuple[str, list[str], int]]:
    """(command, carry, timeout_s) of each call: the kit's calls back to back, the last one installing."""
    seq = [("bash benchmarks/gpu/verify.sh stage", [f".gpukit/call{n}"], STAGE_TIMEOUT_S) for n in range(1, calls)]
    seq.append(("bash benchmarks/gpu/verify.sh stage install probe dropin", [f".gpukit/call{calls}"], FULL_TIMEOUT_S))
    return seq + [(cmd, [], t) for cmd, t in AFTER_KIT]


def describe(seq: list[tuple[str, list[str], int]], calls: int) -> str:
    lines = [f"Device calls for a GPU session: {len(seq)} calls, each within 30 s of the one before (a machine idle "
             f"for 30 s goes back, and a fresh one has lost what was carried and installed); calls 1-{calls} carry "
             "the kit.", ""]
    for i, (cmd, carry, t) in enumerate(seq, 1):
        lines.append(f"{i}. run(command={cmd!r}, carry={carry!r}, timeout_s={t})")
    lines += ["", "Each call returns $OUT/gpu-report/ (report.json, report.md, junit-gpu.xml, logs.tar.gz) so far; "
              "`python benchmarks/gpu/targets.py FILES_AT/gpu-report/report.json` prints the figures against "
              "issue #30's targets. See benchmarks/gpu/README.md."]
    return "\n".join(lines)


def check(kit: Path) -> None:
    """Stage and reassemble the kit as the device will, here: a bad part fails now, not on the GPU's minutes."""
    with tempfile.TemporaryDirectory(prefix="gpukit-check-", dir=os.environ.get("TMPDIR")) as tmp:
        stage(kit, Path(tmp))
        for path in assemble(Path(tmp), Path(tmp) / "wheels"):
            print(f"checked: {path.name} reassembles, sha256 matches", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--package", action="append", help=f"NAME==VERSION to carry (default: {' '.join(PACKAGES)}); "
                                                        "repeat for each; replaces the default list")
    ap.add_argument("--margin-mib", type=float, default=2.0,
                    help="room left in each call beside the working tree, for files added before the calls")
    ap.add_argument("--no-check", action="store_true", help="skip reassembling the kit here")
    args = ap.parse_args(argv)
    try:
        wheels = fetch(args.package or PACKAGES, WHEELS)
        tree = travelling_bytes(ROOT)
        budget = CARRY_LIMIT - tree - int(args.margin_mib * 2**20) - 64 * 1024   # 64 KiB: the manifest
        manifest = split(wheels, KIT, budget)
        if not args.no_check:
            check(KIT)
    except KitError as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 1
    seq = run_calls(manifest["calls"])
    text = describe(seq, manifest["calls"])
    (KIT / "RUNS.md").write_text(text + "\n")
    total = sum(e["size"] for e in manifest["files"].values())
    per_call = [sum(p["size"] for e in manifest["files"].values() for p in e["parts"] if p["call"] == n)
                for n in range(1, manifest["calls"] + 1)]
    print(f"kit {manifest['kit']}: {len(wheels)} wheels, {total / 2**20:.1f} MiB, in {manifest['calls']} calls of "
          f"{max(per_call) / 2**20:.1f} MiB at most (room: {budget / 2**20:.1f} MiB beside the working tree's "
          f"{tree / 2**20:.1f} MiB that travels with each call)\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
