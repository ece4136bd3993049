"""benchmarks/gpu: the fatbin compaction (fatbin.py) and the onnxruntime-gpu kit built on it (ortkit.py), over a small
hand-built ELF whose .nv_fatbin section holds several fatbins of several archs, and a fake wheel around it. Where
cuobjdump is at hand (prepare.py installs it into .gpukit-tools/), NVIDIA's reader checks the same files.
Run from the repository root: PYTHONPATH=. python -m pytest -q benchmarks/tests/test_gpu_fatbin.py"""

import io
import json
import lzma
import os
import shutil
import struct
import tarfile
import zipfile
from pathlib import Path

import sys

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))   # as the kit's scripts import each other: one module each
import fatbin  # noqa: E402
import ortkit  # noqa: E402
from fatbin import FatbinError  # noqa: E402

CUOBJDUMP = next((str(p) for p in [ROOT / ".gpukit-tools" / "nvidia" / "cu13" / "bin" / "cuobjdump"] if p.exists()),
                 shutil.which("cuobjdump"))
needs_cuobjdump = pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (python benchmarks/gpu/prepare.py "
                                                                "installs it into .gpukit-tools/)")


# -- a small ELF, by hand --------------------------------------------------------------------------

def elf(sections: list[tuple[str, bytes]], machine: int = 62, osabi: int = 0, flags: int = 0) -> bytes:
    """A little-endian ELF64 file holding `sections` (name, bytes) and its .shstrtab, 16-byte aligned."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n, _ in sections) + b".shstrtab\0"
    body, places = bytearray(64), []
    for _, data in sections + [(".shstrtab", names)]:
        body += bytes(-len(body) % 16)
        places.append((len(body), len(data)))
        body += data
    body += bytes(-len(body) % 8)
    shoff, headers = len(body), [bytes(64)]
    for (name, _), (offset, size) in zip(sections + [(".shstrtab", b"")], places):
        kind, flag = (3, 0) if name == ".shstrtab" else (1, 2)
        headers.append(struct.pack("<IIQQQQIIQQ", names.index(name.encode() + b"\0"), kind, flag, offset, offset,
                                   size, 0, 0, 8, 0))
    body += b"".join(headers)
    body[:64] = (b"\x7fELF" + bytes([2, 1, 1, osabi, 8 if osabi else 0]) + bytes(7)
                 + struct.pack("<HHIQQQIHHHHHH", 2 if osabi else 3, machine, 1, 0, 0, shoff, flags, 64, 56, 0, 64,
                               len(headers), len(headers) - 1))
    return bytes(body)


def cubin(arch: int, tag: bytes) -> bytes:
    """A tiny CUDA ELF for `arch` (what cuobjdump needs to name and extract it)."""
    return elf([(".text", tag * 9)], machine=190, osabi=0x41, flags=0x06000004 | (arch << 8))


def entry(arch: int, payload: bytes, header_size: int = 64) -> bytes:
    head = struct.pack("<HHIQIIHHI", 2, 0x101, header_size, len(payload), len(payload), 0, 8, 1, arch)
    head += struct.pack("<IQ", 0, 0x11) + bytes(header_size - len(head) - 20) + struct.pack("<Q", len(payload))
    head += bytes(header_size - len(head))
    assert len(head) == header_size
    return head + payload


def fat(entries: list[bytes]) -> bytes:
    payload = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 16, len(payload)) + payload


LAYOUT = [[75, 80, 90], [90, 120], [80, 120], [120, 86, 90]]   # the third has no sm_90: left as it is


def library(layout=LAYOUT) -> bytes:
    fatbins = b"".join(fat([entry(a, cubin(a, f"{i}:{a}:".encode() * (k + 1)), 112 if a == 120 else 64)
                            for k, a in enumerate(archs)]) for i, archs in enumerate(layout))
    return elf([(".text", os.urandom(200)), (".nv_fatbin", fatbins), (".data", os.urandom(77))])


@pytest.fixture
def lib() -> bytes:
    return library()


def naive_zeroing(data: bytes, arch: int) -> bytes:
    """What does not work: the other archs' entries zeroed where they lie, the chosen one not moved."""
    out = bytearray(data)
    off, size = fatbin.section(out)
    for fb in fatbin.parse(memoryview(out)[off:off + size]):
        if any(e.arch == arch for e in fb.entries):
            for e in fb.entries:
                if e.arch != arch:
                    out[off + e.start:off + e.start + e.size] = bytes(e.size)
    return bytes(out)


# -- the compaction ----------------------------------------------------------------------------------

def test_the_synthetic_library_parses_as_laid_out(lib):
    off, size = fatbin.section(lib)
    fatbins = fatbin.parse(lib[off:off + size])
    assert [[e.arch for e in fb.entries] for fb in fatbins] == LAYOUT
    assert {e.header_size for fb in fatbins for e in fb.entries} == {64, 112}
    assert fatbins[0].start == 0 and all(a.end == b.start for a, b in zip(fatbins, fatbins[1:]))


def test_compaction_keeps_one_arch_per_fatbin_in_front_and_moves_nothing_else(lib):
    data = bytearray(lib)
    stats = fatbin.compact(data, 90)
    assert (stats["fatbins"], stats["kept"], stats["untouched"]) == (4, 3, 1)
    assert len(data) == len(lib)
    off, size = fatbin.section(lib)
    assert data[:off] == lib[:off] and data[off + size:] == lib[off + size:]    # outside the section: untouched
    old, new = fatbin.parse(lib[off:off + size]), fatbin.parse(bytes(data[off:off + size]))
    assert [f.start for f in new] == [f.start for f in old]                    # each fatbin where it was
    for a, b in zip(old, new):
        if 90 not in [e.arch for e in a.entries]:
            assert data[off + a.start:off + a.end] == lib[off + a.start:off + a.end]
            continue
        keep = next(e for e in a.entries if e.arch == 90)
        assert [e.arch for e in b.entries] == [90] and b.entries[0].start == b.start + 16
        assert b.payload_size == keep.size
        assert data[off + b.entries[0].start:off + b.end] == lib[off + keep.start:off + keep.start + keep.size]
        assert not any(data[off + b.end:off + a.end])                           # zeros to the old end
    assert stats["zeroed_bytes"] == sum(f.payload_size for f in old) - sum(f.payload_size for f in new)
    assert fatbin.check(lib, bytes(data), 90) == {"fatbins": 4, "kept": 3, "arch_entries": 3}


def test_the_check_finds_any_difference(lib):
    good = bytearray(lib)
    fatbin.compact(good, 90)
    off, size = fatbin.section(lib)
    new = fatbin.parse(bytes(good[off:off + size]))
    e = new[1].entries[0]
    cases = {"differs from the original": off + e.start + e.header_size + 5,   # inside a kept program
             "not zero|no fatbin magic": off + new[1].end + 3,                   # in the zeroed tail
             "outside .nv_fatbin": 70}                                            # in .text
    for what, at in cases.items():
        bad = bytearray(good)
        bad[at] ^= 0x5A
        with pytest.raises(FatbinError, match=what):
            fatbin.check(lib, bytes(bad), 90)
    with pytest.raises(FatbinError, match="sizes differ"):
        fatbin.check(lib, bytes(good) + b"\0", 90)


def test_zeroing_the_other_archs_in_place_is_caught(lib):
    with pytest.raises(FatbinError):
        fatbin.check(lib, naive_zeroing(lib, 90), 90)


def test_an_arch_no_fatbin_holds_is_refused_and_named(lib):
    with pytest.raises(FatbinError, match=r"no fatbin holds code for sm_89: .*\[75, 80, 86, 90, 120\]"):
        fatbin.compact(bytearray(lib), 89)


def test_compaction_to_another_arch(lib):
    data = bytearray(lib)
    assert fatbin.compact(data, 120)["kept"] == 3
    assert fatbin.check(lib, bytes(data), 120)["kept"] == 3


def test_what_is_not_a_fatbin_library_is_a_clear_error(lib):
    with pytest.raises(FatbinError, match="not a little-endian 64-bit ELF"):
        fatbin.section(b"MZ" + bytes(100))
    with pytest.raises(FatbinError, match="no .nv_fatbin section"):
        fatbin.section(elf([(".text", b"\x90" * 10)]))
    broken = bytearray(lib)
    off, _ = fatbin.section(lib)
    broken[off] ^= 0xFF
    with pytest.raises(FatbinError, match="no fatbin magic at section offset 0x0"):
        fatbin.compact(broken, 90)


@pytest.mark.parametrize("spec, number, label", [("sm_90a", 90, "sm_90a"), ("90a", 90, "sm_90a"), ("SM_80", 80, "sm_80"),
                                                 (120, 120, "sm_120"), ("sm90a", 90, "sm_90a")])
def test_arch_names(spec, number, label):
    assert fatbin.parse_arch(spec) == number and fatbin.arch_label(spec) == label


def test_a_bad_arch_name_is_refused():
    with pytest.raises(FatbinError, match="not a GPU architecture: 'hopper'"):
        fatbin.parse_arch("hopper")


@needs_cuobjdump
def test_cuobjdump_reads_the_compacted_library_and_finds_the_same_programs(lib, tmp_path):
    original, compacted = tmp_path / "original.so", tmp_path / "compacted.so"
    original.write_bytes(lib)
    data = bytearray(lib)
    fatbin.compact(data, 90)
    compacted.write_bytes(data)
    assert fatbin.cuobjdump_check(CUOBJDUMP, original, compacted, 90)["programs"] == 3
    zeroed = tmp_path / "zeroed.so"
    zeroed.write_bytes(naive_zeroing(lib, 90))
    with pytest.raises(FatbinError):          # cuobjdump cannot read it, or finds other programs
        fatbin.cuobjdump_check(CUOBJDUMP, original, zeroed, 90)


# -- the kit -----------------------------------------------------------------------------------------

def fake_wheel(folder: Path, lib: bytes) -> Path:
    """An onnxruntime-gpu wheel in miniature: the files the kit keeps, and each kind it drops."""
    path = folder / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    files = {"onnxruntime/__init__.py": b"__version__ = '1.31.1'\n",
             "onnxruntime/capi/__init__.py": b"",
             "onnxruntime/capi/onnxruntime_pybind11_state.cpython-312-x86_64-linux-gnu.so": b"\x7fELF pybind",
             "onnxruntime/capi/libonnxruntime_providers_shared.so": b"\x7fELF shared",
             ortkit.CUDA_PROVIDER: lib,
             "onnxruntime/capi/libonnxruntime.so.1.31.1": b"\x7fELF C API",
             "onnxruntime/capi/libonnxruntime_providers_tensorrt.so": b"\x7fELF TensorRT",
             "onnxruntime/transformers/models/x.py": b"x = 1\n",
             "onnxruntime/quantization/q.py": b"q = 1\n",
             "onnxruntime/tools/t.py": b"t = 1\n",
             "onnxruntime/backend/__init__.py": b"",
             "onnxruntime_gpu-1.31.1.dist-info/METADATA": b"Name: onnxruntime-gpu\nVersion: 1.31.1\n"}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            z.writestr(info, data)
        z.writestr("onnxruntime/capi/", b"")    # a directory entry
    return path


KEPT = {"onnxruntime/__init__.py", "onnxruntime/capi/__init__.py", ortkit.CUDA_PROVIDER,
        "onnxruntime/capi/onnxruntime_pybind11_state.cpython-312-x86_64-linux-gnu.so",
        "onnxruntime/capi/libonnxruntime_providers_shared.so", "onnxruntime/backend/__init__.py",
        "onnxruntime_gpu-1.31.1.dist-info/METADATA"}


def test_the_kit_keeps_what_the_cuda_provider_needs_compacted_and_unpacks_with_python_alone(lib, tmp_path):
    wheel = fake_wheel(tmp_path, lib)
    kit = tmp_path / "ort-kit.tar.xz"
    record = ortkit.build(wheel, kit, "sm_90a", cuobjdump=None, log=lambda text: None)
    assert record["kit_files"] == len(KEPT) and record["wheel_files"] == 12
    assert record["arch"] == "sm_90a" and record["compaction"]["kept"] == 3 and record["cuobjdump"] is None
    assert record["kit_bytes"] == kit.stat().st_size
    assert json.loads(kit.with_name(kit.name + ".json").read_text()) == record
    with lzma.open(kit) as f:                  # xz with the x86 filter, as xz --x86 writes it
        assert sorted(tarfile.open(fileobj=f).getnames()) == sorted(KEPT)
    site = tmp_path / "site"
    assert ortkit.unpack(kit, site)["files"] == len(KEPT)
    got = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}
    assert got == KEPT
    unpacked = (site / ortkit.CUDA_PROVIDER).read_bytes()
    assert unpacked != lib and fatbin.check(lib, unpacked, 90)["kept"] == 3
    assert os.access(site / ortkit.CUDA_PROVIDER, os.X_OK)
    again = tmp_path / "again.tar.xz"
    ortkit.build(wheel, again, "sm_90a", cuobjdump=None, log=lambda text: None)
    assert again.read_bytes() == kit.read_bytes()      # the same bytes every build: the manifest's sha256 holds


@needs_cuobjdump
def test_the_kit_build_checks_with_cuobjdump(lib, tmp_path):
    record = ortkit.build(fake_wheel(tmp_path, lib), tmp_path / "k.tar.xz", "sm_90a", CUOBJDUMP, log=lambda t: None)
    assert record["cuobjdump"]["programs"] == 3


def test_a_wheel_without_the_cuda_provider_is_refused(tmp_path):
    path = tmp_path / "onnxruntime-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("onnxruntime/__init__.py", b"")
    with pytest.raises(FatbinError, match="not an onnxruntime-gpu wheel"):
        ortkit.build(path, tmp_path / "k.tar.xz", log=lambda t: None)


def test_unpack_refuses_a_member_outside_the_folder(tmp_path):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("../escaped.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    kit = tmp_path / "bad.tar.xz"
    kit.write_bytes(lzma.compress(raw.getvalue()))
    with pytest.raises(FatbinError, match="unexpected member '../escaped.py'"):
        ortkit.unpack(kit, tmp_path / "site")
    assert not (tmp_path / "escaped.py").exists()
