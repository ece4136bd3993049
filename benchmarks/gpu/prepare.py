"""Prepare what a 15-minute GPU session carries to the device machine, and print the calls to make.

    python benchmarks/gpu/prepare.py [--arch sm_90a] [--margin-mib 1] [--cuobjdump PATH] [--no-check]

Run it in the checkout the session was started in (the device tool sends that one). It
1. gets the wheels the GPU image lacks (shared/GPU.md): onnxruntime-gpu 1.31.1 (CUDA 13) and pyzmq 27.3.0,
   with `pip download` into .gpukit-wheels/ (kept: a second run downloads nothing);
2. builds the compacted onnxruntime-gpu kit (ortkit.py: the 27 files the CUDA provider needs, its fatbins
   cut to one arch, xz) into .gpukit-wheels/, checked against the wheel byte by byte and, with cuobjdump
   (pip nvidia-cuda-cuobjdump into .gpukit-tools/ when none is given), program by program: a failed check
   stops here. Built once per wheel and arch (~3 min, xz); later runs reuse it;
3. measures what travels with every call anyway (tracked and untracked-not-ignored files, shared/), and
   cuts pyzmq and the kit into the fewest calls that fit beside it under the 64 MiB a call carries:
   .gpukit/call1 (and call2 if need be), each with manifest.json (sha256 of every file and part);
4. stages and reassembles the kit here as the device will, and
5. prints the plan (plan.py): the calls with command, carry and timeout_s, and the plan's total, also
   written to .gpukit/RUNS.md.
The folders are git-ignored: nothing here goes into a commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ortkit  # noqa: E402  (beside this script; stdlib only)
from chunks import KitError, assemble, sha256_file, split, stage  # noqa: E402
from fatbin import FatbinError, arch_label  # noqa: E402
from plan import PlanError, calls, describe, total_s, PLAN_LIMIT_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpukit"
WHEELS = ROOT / ".gpukit-wheels"
TOOLS = ROOT / ".gpukit-tools"
CARRY_LIMIT = 64 * 2**20          # the device tool's working tree + carried paths, per call
MANIFEST_ALLOWANCE = 64 * 1024    # each call folder's manifest.json
ORT = "onnxruntime-gpu==1.31.1"
ZMQ = "pyzmq==27.3.0"
CUOBJDUMP = "nvidia-cuda-cuobjdump==13.5.37"
KIT_FORMAT = 1                    # bump when ortkit.build changes what it writes: the cached kit is rebuilt
# The GPU image's python3 is CPython 3.12 on x86-64 (its pip accepts manylinux wheels up to glibc 2.39).
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:", "--no-deps"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux1_x86_64") for a in ("--platform", p)]


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


def find_cuobjdump(given: str | None) -> str:
    """cuobjdump to check the compaction with: the one given, the one in .gpukit-tools/, else pip installs it
    there. A KitError when there is none: the kit is not built unchecked."""
    if given:
        return given
    path = TOOLS / "nvidia" / "cu13" / "bin" / "cuobjdump"
    if not path.exists():
        print(f"installing {CUOBJDUMP} into {TOOLS.name}/ (to check the compacted library) ...", file=sys.stderr)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TOOLS),
                            CUOBJDUMP], capture_output=True, text=True)
        if r.returncode != 0 or not path.exists():
            raise KitError(f"no cuobjdump: pip install {CUOBJDUMP} failed "
                           f"({(r.stderr.strip().splitlines() or ['no message'])[-1]}); give one with --cuobjdump")
    path.chmod(0o755)
    return str(path)


def ort_kit(wheel: Path, arch: str, cuobjdump: str) -> tuple[Path, dict]:
    """The compacted kit for `wheel` and `arch`: the one built before when it matches, else built now."""
    name = wheel.name.split("-")[1]
    out = WHEELS / f"ort-kit-{name}-{arch_label(arch)}.tar.xz"
    record_path = out.with_name(out.name + ".json")
    digest = sha256_file(wheel)
    try:
        record = json.loads(record_path.read_text())
        if (record.get("wheel_sha256") == digest and record.get("format") == KIT_FORMAT and record.get("cuobjdump")
                and out.exists() and sha256_file(out) == record.get("kit_sha256")):
            print(f"{out.name}: built before, {record['kit_bytes'] / 2**20:.1f} MiB (cuobjdump-checked)", file=sys.stderr)
            return out, record
    except (OSError, ValueError):
        pass
    print(f"building {out.name} (xz takes ~3 min) ...", file=sys.stderr, flush=True)
    record = ortkit.build(wheel, out, arch, cuobjdump, log=lambda text: print(text, file=sys.stderr, flush=True))
    record.update(wheel_sha256=digest, format=KIT_FORMAT, kit_sha256=sha256_file(out))
    record_path.write_text(json.dumps(record, indent=1))
    return out, record


def travelling_bytes(root: Path) -> int:
    """What every call sends besides the carried paths: tracked and untracked-not-ignored files, and shared/."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, check=True).stdout.decode().split("\0")
    files = {root / n for n in names if n}
    if (root / "shared").is_dir():
        files |= {p for p in (root / "shared").rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in files if p.is_file() and not p.is_symlink())


def check(kit: Path) -> None:
    """Stage and reassemble the kit as the device will, here: a bad part fails now, not on the GPU's minutes."""
    with tempfile.TemporaryDirectory(prefix="gpukit-check-", dir=os.environ.get("TMPDIR")) as tmp:
        stage(kit, Path(tmp))
        for path in assemble(Path(tmp), Path(tmp) / "files"):
            print(f"checked: {path.name} reassembles, sha256 matches", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="sm_90a", help="the lent GPU's arch (H100, H200: sm_90a)")
    ap.add_argument("--margin-mib", type=float, default=1.0,
                    help="room left in each call beside the working tree, for files added before the calls")
    ap.add_argument("--cuobjdump", help=f"cuobjdump to check the compaction with (default: pip {CUOBJDUMP} "
                                        f"in {TOOLS.name}/)")
    ap.add_argument("--no-check", action="store_true", help="skip reassembling the kit here")
    args = ap.parse_args(argv)
    try:
        ort_wheel, zmq_wheel = fetch([ORT, ZMQ], WHEELS)
        kit, record = ort_kit(ort_wheel, args.arch, find_cuobjdump(args.cuobjdump))
        tree = travelling_bytes(ROOT)
        budget = CARRY_LIMIT - tree - int(args.margin_mib * 2**20) - MANIFEST_ALLOWANCE
        # pyzmq first: the first call's tier stage needs it, whatever part of the kit comes later
        manifest = split([zmq_wheel, kit.with_name(kit.name + ".json"), kit], KIT, budget)
        seq = calls(manifest["calls"])
        if not args.no_check:
            check(KIT)
    except (KitError, FatbinError, PlanError) as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 1
    per_call = [sum(p["size"] for e in manifest["files"].values() for p in e["parts"] if p["call"] == n)
                for n in range(1, manifest["calls"] + 1)]
    c = record["compaction"]
    summary = [
        f"onnxruntime-gpu kit: {kit.name} {record['kit_bytes'] / 2**20:.1f} MiB ({record['kit_files']} of "
        f"{record['wheel_files']} files, {record['kit_unpacked_bytes'] / 2**20:.1f} MiB unpacked; "
        f"{c['kept']} of {c['fatbins']} fatbins cut to {record['arch']}, "
        f"{record['cuobjdump']['programs']} programs sha256-identical by cuobjdump; xz {record['xz_seconds']} s)",
        f"pyzmq: {zmq_wheel.name} {zmq_wheel.stat().st_size / 2**20:.1f} MiB",
        f"working tree travelling with every call: {tree / 2**20:.2f} MiB; room beside it: {budget / 2**20:.2f} MiB "
        f"(64 MiB less {args.margin_mib:g} MiB margin and the manifest)",
        f"carried in {manifest['calls']} call(s): " + ", ".join(f"call{n} {b / 2**20:.1f} MiB"
                                                              for n, b in enumerate(per_call, 1)),
        "", describe(seq)]
    text = "\n".join(summary)
    (KIT / "RUNS.md").write_text(text + "\n")
    print(text)
    if total_s(seq) > PLAN_LIMIT_S:
        print(f"prepare: the plan takes up to {total_s(seq)} s, over {PLAN_LIMIT_S} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
