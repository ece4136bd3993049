"""The CUDA fatbins of an ELF shared library, compacted in place to one GPU architecture, and checked against the original.

Standard library only. A library built for several GPUs (onnxruntime-gpu's libonnxruntime_providers_cuda.so:
sm_75 ... sm_120a) keeps its GPU code in the `.nv_fatbin` section as fatbins laid end to end:

    fatbin header (16 bytes)  u32 magic 0xBA55ED50, u16 version, u16 header size, u64 payload size
    entries, one per arch     u16 kind, u16 version, u32 entry-header size, u64 payload size, ..., u32 SM arch
                              at offset 28, ...; then the payload (a cubin, compressed by fatbinary)

`compact` moves the chosen arch's entry of each fatbin right behind that fatbin's header, sets the header's
payload size to that entry's length and zeroes the rest of the fatbin. Nothing else in the file moves: each
fatbin still starts where the library's registration record (`.nvFatBinSegment`) points, and the bytes
outside `.nv_fatbin` are the original's. Zeros compress to nothing, so the kit carries one arch's code.
(Zeroing the other entries without moving the chosen one breaks the fatbin: cuobjdump then reads the
zeros as an entry, "Uncompress failed".) A fatbin without the chosen arch is left as it is.

`check` proves the result from the two files alone; `cuobjdump_check` proves it with NVIDIA's own reader.
"""

from __future__ import annotations

import hashlib
import re
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
SECTION = ".nv_fatbin"
_HEADER = struct.Struct("<IHHQ")      # magic, version, header size, payload size
_ENTRY = struct.Struct("<HHIQ")       # kind, version, entry-header size, payload size
ARCH_OFFSET = 28                      # u32 SM arch inside an entry header (90 for sm_90a, 120 for sm_120a)
_NONZERO = re.compile(rb"[^\x00]")


class FatbinError(Exception):
    """The library is not what the compaction expects, or the compacted one differs from the original."""


@dataclass
class Entry:
    start: int           # offset in the section
    kind: int
    header_size: int
    payload_size: int
    arch: int

    @property
    def size(self) -> int:
        return self.header_size + self.payload_size


@dataclass
class Fatbin:
    start: int           # offset in the section
    version: int
    header_size: int
    payload_size: int
    entries: list = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.header_size + self.payload_size


def parse_arch(spec: str | int) -> int:
    """'sm_90a', '90a', 'sm_90', 90 -> 90: the number in an entry header (the 'a' variants share it)."""
    return int(_arch_match(spec).group(1))


def arch_label(spec: str | int) -> str:
    """'90a', 'SM_90a', 90 -> 'sm_90a', 'sm_90a', 'sm_90': the name cuobjdump gives (for file names, reports)."""
    m = _arch_match(spec)
    return f"sm_{m.group(1)}{m.group(2)}"


def _arch_match(spec):
    m = re.fullmatch(r"(?:sm_?)?(\d+)([a-z]?)", str(spec).strip().lower())
    if not m:
        raise FatbinError(f"not a GPU architecture: {spec!r} (expected e.g. sm_90a, sm_80, 120)")
    return m


def section(data: bytes | bytearray, name: str = SECTION) -> tuple[int, int]:
    """(file offset, size) of the named section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a little-endian 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff == 0 or shnum == 0:
        raise FatbinError("the ELF file has no section headers (it cannot be found without them)")

    def header(i: int) -> tuple:
        # name, type, flags, addr, offset, size
        return struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)

    strtab_off, strtab_size = header(shstrndx)[4:6]
    names = bytes(data[strtab_off:strtab_off + strtab_size])
    for i in range(shnum):
        sh_name, _, _, _, offset, size = header(i)
        if names[sh_name:names.index(b"\0", sh_name)].decode(errors="replace") == name:
            if offset + size > len(data):
                raise FatbinError(f"section {name} runs past the end of the file")
            return offset, size
    raise FatbinError(f"no {name} section: this library holds no CUDA fatbins")


def parse(sec: bytes | bytearray | memoryview) -> list[Fatbin]:
    """Every fatbin of a `.nv_fatbin` section, with its entries; a FatbinError where the layout breaks."""
    out, pos, size = [], 0, len(sec)
    while pos < size:
        if size - pos < _HEADER.size:
            if any(sec[pos:]):
                raise FatbinError(f"{size - pos} stray bytes at the end of the section")
            break
        magic, version, header_size, payload_size = _HEADER.unpack_from(sec, pos)
        if magic != FATBIN_MAGIC:
            if magic == 0:      # zeros: what a compacted fatbin left after its entry, or padding
                nonzero = _NONZERO.search(sec, pos)
                if nonzero is None:
                    break
                pos = nonzero.start()
                continue
            raise FatbinError(f"no fatbin magic at section offset {pos:#x} (found {magic:#010x})")
        fb = Fatbin(pos, version, header_size, payload_size)
        if fb.end > size:
            raise FatbinError(f"fatbin at {pos:#x} runs past the section ({fb.end:#x} > {size:#x})")
        e = pos + header_size
        while e < fb.end:
            kind, _, eh_size, ep_size = _ENTRY.unpack_from(sec, e)
            if eh_size < ARCH_OFFSET + 4 or e + eh_size + ep_size > fb.end:
                raise FatbinError(f"fatbin at {pos:#x}: entry at {e:#x} does not fit (header {eh_size}, "
                                  f"payload {ep_size})")
            arch, = struct.unpack_from("<I", sec, e + ARCH_OFFSET)
            fb.entries.append(Entry(e, kind, eh_size, ep_size, arch))
            e += eh_size + ep_size
        out.append(fb)
        pos = fb.end
    return out


def compact(data: bytearray, arch: int) -> dict:
    """Keep only `arch`'s entry in every fatbin of `data` (a whole ELF file, changed in place).
    Returns counts and bytes: fatbins, kept (compacted), untouched (no entry of that arch), bytes zeroed."""
    off, size = section(data)
    sec = memoryview(data)[off:off + size]
    fatbins = parse(sec)
    kept = untouched = zeroed = 0
    for fb in fatbins:
        chosen = [e for e in fb.entries if e.arch == arch]
        if not chosen:
            untouched += 1
            continue
        if len(chosen) > 1:
            raise FatbinError(f"fatbin at {fb.start:#x} holds {len(chosen)} entries for sm_{arch}: which to keep "
                              "is not known")
        e = chosen[0]
        entry = bytes(sec[e.start:e.start + e.size])
        first = fb.start + fb.header_size
        sec[first:first + e.size] = entry
        sec[first + e.size:fb.end] = bytes(fb.end - first - e.size)
        struct.pack_into("<Q", sec, fb.start + 8, e.size)
        zeroed += fb.payload_size - e.size
        kept += 1
    sec.release()
    if kept == 0:
        raise FatbinError(f"no fatbin holds code for sm_{arch}: the kit would run nothing on that GPU "
                          f"(archs present: {sorted({e.arch for fb in fatbins for e in fb.entries})})")
    return {"fatbins": len(fatbins), "kept": kept, "untouched": untouched, "zeroed_bytes": zeroed,
            "section_bytes": size, "arch": arch}


def check(original: bytes, compacted: bytes, arch: int) -> dict:
    """From the bytes alone: every byte outside `.nv_fatbin` unchanged; each fatbin starts where it did; each
    compacted fatbin is its header, the original's `arch` entry byte for byte, then zeros; the others unchanged.
    Returns counts; a FatbinError names the first difference."""
    if len(original) != len(compacted):
        raise FatbinError(f"sizes differ: {len(original)} bytes, compacted {len(compacted)}")
    off, size = section(original)
    if section(compacted) != (off, size):
        raise FatbinError("the .nv_fatbin section moved")
    if original[:off] != compacted[:off] or original[off + size:] != compacted[off + size:]:
        raise FatbinError("bytes outside .nv_fatbin differ")
    old = parse(memoryview(original)[off:off + size])
    new = parse(memoryview(compacted)[off:off + size])
    if [f.start for f in old] != [f.start for f in new]:
        raise FatbinError("the fatbins do not start where they did")
    kept = 0
    for a, b in zip(old, new):
        want = [e for e in a.entries if e.arch == arch]
        if not want:
            if original[off + a.start:off + a.end] != compacted[off + b.start:off + b.end]:
                raise FatbinError(f"fatbin at {a.start:#x} (no sm_{arch} entry) changed")
            continue
        e, where = want[0], off + b.start + b.header_size
        if len(b.entries) != 1 or b.entries[0].arch != arch or b.payload_size != e.size:
            raise FatbinError(f"fatbin at {a.start:#x}: not one sm_{arch} entry of {e.size} bytes")
        if compacted[where:where + e.size] != original[off + e.start:off + e.start + e.size]:
            raise FatbinError(f"fatbin at {a.start:#x}: its sm_{arch} entry differs from the original's")
        if any(compacted[where + e.size:off + a.end]):
            raise FatbinError(f"fatbin at {a.start:#x}: bytes after its entry are not zero")
        if compacted[off + a.start:off + a.start + 8] != original[off + a.start:off + a.start + 8]:
            raise FatbinError(f"fatbin at {a.start:#x}: its header changed beyond the payload size")
        kept += 1
    return {"fatbins": len(old), "kept": kept, "arch_entries": sum(e.arch == arch for f in old for e in f.entries)}


# -- NVIDIA's reader ----------------------------------------------------------------------------------

def arch_programs(cuobjdump: str, library: Path, arch: int, work: Path) -> list[str]:
    """sha256 of every sm_<arch> program cuobjdump extracts from `library`, in the library's order."""
    listing = subprocess.run([cuobjdump, "--list-elf", str(library)], capture_output=True, text=True)
    if listing.returncode != 0:
        raise FatbinError(f"cuobjdump --list-elf {library.name} failed: {listing.stderr.strip()[-500:]}")
    tag = re.compile(rf"\.sm_{arch}[a-z]?\.cubin$")
    names = [line.split()[-1] for line in listing.stdout.splitlines() if line.startswith("ELF file")]
    wanted = [n for n in names if tag.search(n)]
    if not wanted:
        raise FatbinError(f"cuobjdump lists no sm_{arch} program in {library.name}")
    folder = work / library.name
    folder.mkdir(parents=True)
    r = subprocess.run([cuobjdump, "--extract-elf", f"sm_{arch}", str(library.resolve())], cwd=folder,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise FatbinError(f"cuobjdump --extract-elf sm_{arch} {library.name} failed: {r.stderr.strip()[-500:]}")
    missing = [n for n in wanted if not (folder / n).exists()]
    if missing:
        raise FatbinError(f"cuobjdump extracted {len(wanted) - len(missing)} of the {len(wanted)} sm_{arch} programs "
                          f"it lists in {library.name} (first missing: {missing[0]})")
    sums = [hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in wanted]
    for n in wanted:
        (folder / n).unlink()
    return sums


def cuobjdump_check(cuobjdump: str, original: Path, compacted: Path, arch: int) -> dict:
    """Both libraries through cuobjdump: the same sm_<arch> programs, in the same order, sha256 for sha256."""
    if "/" in cuobjdump:
        cuobjdump = str(Path(cuobjdump).resolve())     # it runs in a folder of its own
    with tempfile.TemporaryDirectory(prefix="fatbin-check-") as tmp:
        before = arch_programs(cuobjdump, original, arch, Path(tmp))
        after = arch_programs(cuobjdump, compacted, arch, Path(tmp))
    if before != after:
        bad = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b) if len(before) == len(after) else None
        raise FatbinError(f"cuobjdump: {len(before)} sm_{arch} programs in the original, {len(after)} in the "
                          "compacted library" + (f"; program {bad + 1} differs" if bad is not None else ""))
    return {"programs": len(before), "sha256_of_list": hashlib.sha256("".join(before).encode()).hexdigest()}
