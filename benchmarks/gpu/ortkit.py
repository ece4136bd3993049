"""onnxruntime-gpu cut to what its CUDA provider needs, compacted to one GPU arch, packed small enough to carry.

Standard library only: `unpack` runs on the GPU machine before anything is installed.

    python benchmarks/gpu/ortkit.py build WHEEL OUT.tar.xz [--arch sm_90a] [--cuobjdump PATH]   (here)
    python3 benchmarks/gpu/ortkit.py unpack KIT.tar.xz SITE                                     (there)

`build` keeps the `onnxruntime` package and its dist-info, less what the CUDA provider never loads
(DROPPED: the C API library, which the Python module does not link or open; the TensorRT provider, which
needs libnvinfer; transformers/, quantization/, tools/), compacts the CUDA provider's fatbins to one arch
(fatbin.py), checks the result byte by byte and, with cuobjdump, program by program against the original,
and packs a tar with xz's x86 filter and LZMA2 preset 9. The libraries are not stripped: the wheel's are
already (strip --strip-unneeded gains 256 bytes a file), and unstripped, every byte outside `.nv_fatbin`
is the original's, which `fatbin.check` proves. `unpack` is Python's lzma + tarfile (the GPU image has no
xz binary).
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path, PurePosixPath

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fatbin import FatbinError, arch_label, check, compact, cuobjdump_check, parse_arch  # noqa: E402

CUDA_PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
DROPPED_DIRS = ("onnxruntime/transformers/", "onnxruntime/quantization/", "onnxruntime/tools/")
DROPPED_LIBS = ("onnxruntime/capi/libonnxruntime.so", "onnxruntime/capi/libonnxruntime_providers_tensorrt.so")
# xz --x86 --lzma2=preset=9: the BCJ filter turns relative calls into absolute ones, which repeat more.
FILTERS = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9}]


def kept(name: str) -> bool:
    """Whether a wheel member goes into the kit."""
    top = name.split("/", 1)[0]
    if top != "onnxruntime" and not (top.startswith("onnxruntime_gpu-") and top.endswith(".dist-info")):
        return False
    return not name.endswith("/") and not name.startswith(DROPPED_DIRS) and not name.startswith(DROPPED_LIBS)


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes, mode: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0      # mtime 0, no owner: the same bytes every build
    tar.addfile(info, io.BytesIO(data))


def build(wheel: Path, out: Path, arch: str = "sm_90a", cuobjdump: str | None = None, log=print) -> dict:
    """Write the kit to `out` (atomically) and out.json beside it with what was measured; returns that dict.
    Without `cuobjdump` the program-by-program check is skipped, and the record says so."""
    sm = parse_arch(arch)
    t_start = time.monotonic()
    with zipfile.ZipFile(wheel) as z:
        members = [i for i in z.infolist() if not i.is_dir()]
        keep = sorted((i for i in members if kept(i.filename)), key=lambda i: i.filename)
        if CUDA_PROVIDER not in {i.filename for i in keep}:
            raise FatbinError(f"{wheel.name} has no {CUDA_PROVIDER}: not an onnxruntime-gpu wheel")
        files = {i.filename: z.read(i) for i in keep}
        modes = {i.filename: (i.external_attr >> 16) & 0o777 or 0o644 for i in keep}
    record = {"wheel": wheel.name, "wheel_bytes": wheel.stat().st_size, "wheel_files": len(members),
              "wheel_unpacked_bytes": sum(i.file_size for i in members), "kit_files": len(files),
              "kit_unpacked_bytes": sum(len(b) for b in files.values()), "arch": arch_label(arch)}
    log(f"{wheel.name}: {len(members)} files, {record['wheel_unpacked_bytes'] / 2**20:.1f} MiB unpacked; keeping "
        f"{len(files)} ({record['kit_unpacked_bytes'] / 2**20:.1f} MiB)")

    original = files[CUDA_PROVIDER]
    t = time.monotonic()
    data = bytearray(original)
    record["compaction"] = compact(data, sm)
    record["compaction"]["check"] = check(original, bytes(data), sm)
    record["compaction"]["seconds"] = round(time.monotonic() - t, 1)
    files[CUDA_PROVIDER] = bytes(data)
    c = record["compaction"]
    log(f"compacted {CUDA_PROVIDER.rsplit('/', 1)[1]} to {record['arch']}: {c['kept']} of {c['fatbins']} fatbins, "
        f"{c['zeroed_bytes'] / 2**20:.1f} MiB of other archs zeroed; byte check passed")
    if cuobjdump:
        t = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="ortkit-") as tmp:
            a, b = Path(tmp) / "original.so", Path(tmp) / "compacted.so"
            a.write_bytes(original)
            b.write_bytes(data)
            record["cuobjdump"] = cuobjdump_check(cuobjdump, a, b, sm)
        record["cuobjdump"]["seconds"] = round(time.monotonic() - t, 1)
        log(f"cuobjdump: the {record['cuobjdump']['programs']} {record['arch']} programs are sha256-identical to the "
            f"original's ({record['cuobjdump']['seconds']} s)")
    else:
        record["cuobjdump"] = None
        log("cuobjdump: NOT checked (no cuobjdump given)")
    del data, original

    t = time.monotonic()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            _tar_member(tar, name, files[name], modes[name])
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(lzma.compress(raw.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=FILTERS))
    tmp.rename(out)
    record["xz_seconds"] = round(time.monotonic() - t, 1)
    record["kit_bytes"] = out.stat().st_size
    record["build_seconds"] = round(time.monotonic() - t_start, 1)
    log(f"{out.name}: {record['kit_bytes'] / 2**20:.1f} MiB (xz --x86 --lzma2=preset=9 in {record['xz_seconds']} s)")
    out.with_name(out.name + ".json").write_text(json.dumps(record, indent=1))
    return record


def unpack(kit: Path, site: Path) -> dict:
    """Extract the kit into `site` (a folder put on PYTHONPATH); returns the files and seconds it took."""
    t = time.monotonic()
    site.mkdir(parents=True, exist_ok=True)
    n = 0
    with lzma.open(kit) as xz, tarfile.open(fileobj=xz, mode="r|") as tar:
        for member in tar:
            path = PurePosixPath(member.name)
            if not member.isfile() or path.is_absolute() or ".." in path.parts:
                raise FatbinError(f"{kit.name}: unexpected member {member.name!r}")
            target = site / path
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                while block := src.read(1 << 20):
                    dst.write(block)
            target.chmod(member.mode)
            n += 1
    return {"files": n, "seconds": round(time.monotonic() - t, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="here: the kit from the wheel")
    b.add_argument("wheel", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--arch", default="sm_90a", help="the GPU's arch (H100/H200: sm_90a)")
    b.add_argument("--cuobjdump", help="cuobjdump to check the compacted programs with (pip nvidia-cuda-cuobjdump)")
    u = sub.add_parser("unpack", help="there: the kit into a folder for PYTHONPATH")
    u.add_argument("kit", type=Path)
    u.add_argument("site", type=Path)
    u.add_argument("--record", type=Path, help="write what the unpack took here (JSON)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "build":
            build(args.wheel, args.out, args.arch, args.cuobjdump)
        else:
            r = unpack(args.kit, args.site)
            if args.record:
                args.record.write_text(json.dumps({**r, "kit": args.kit.name, "kit_bytes": args.kit.stat().st_size}))
            print(f"{args.kit.name}: {r['files']} files into {args.site} in {r['seconds']} s")
    except (FatbinError, OSError, lzma.LZMAError, tarfile.TarError) as e:
        print(f"ortkit: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
