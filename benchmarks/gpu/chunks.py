"""Files cut to fit the device tool's per-call carry, and put back together there, checked by sha256.

Standard library only: the GPU machine runs this with its own python3 before anything is installed.

Here (prepare.py):  split(files, kit_dir, budget) -> .gpukit/call1/, call2/, ... each with manifest.json
There (verify.sh):  python3 benchmarks/gpu/chunks.py stage KIT_DIR STATE_DIR      every call: keep what came
                    python3 benchmarks/gpu/chunks.py assemble STATE_DIR DEST_DIR [PATTERN ...]
                                                          the files (named like PATTERN) whose parts are there

A call carries one `callN` folder: the tool replaces each carried path on the device and keeps nothing it
did not carry in a place we choose, so `stage` copies each checked part out of the working tree into
STATE_DIR, which lives as long as the machine stays warm (30 s after a call).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"


class KitError(Exception):
    """What is wrong with the carried kit, and what to do; verify.sh prints it as one line."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def plan(sizes: dict[str, int], budget: int) -> list[list[tuple[str, str, int, int]]]:
    """Calls, each a list of (file, part name, offset, length): the files, in the order given (what the first
    call needs goes first), laid end to end and cut into the fewest calls of at most `budget` bytes, all of
    one size. A file that crosses a cut travels as parts (NAME.partKKofNN); one that does not, whole."""
    if budget <= 0:
        raise KitError(f"no room for weights in a call (budget {budget} bytes): the working tree alone fills the "
                       "carry limit; ignore or remove large untracked files")
    total = sum(sizes.values())
    n = max(1, math.ceil(total / budget))
    per_call = max(1, math.ceil(total / n))
    pieces: dict[str, list] = {}
    pos = 0
    for name, size in sizes.items():
        pieces[name] = [(min(pos // per_call, n - 1), 0, 0)] if size == 0 else []   # an empty file travels too
        offset = 0
        while offset < size:
            call = pos // per_call
            length = min((call + 1) * per_call - pos, size - offset)
            pieces[name].append((call, offset, length))
            pos, offset = pos + length, offset + length
    calls: list[list] = [[] for _ in range(n)]
    for name, cut in pieces.items():
        for k, (call, offset, length) in enumerate(cut, 1):
            part = name if len(cut) == 1 else f"{name}.part{k:02d}of{len(cut):02d}"
            calls[call].append((name, part, offset, length))
    return calls


def split(files: list[Path], kit_dir: Path, budget: int) -> dict:
    """Write kit_dir/callN/ (the parts of call N and the manifest) for `files`; returns the manifest.
    Anything already in kit_dir is removed first: parts of an older kit must not travel with this one."""
    if len({f.name for f in files}) != len(files):
        raise KitError("two files of the kit share a name: " + ", ".join(sorted(f.name for f in files)))
    by_name = {f.name: f for f in files}
    calls = plan({f.name: f.stat().st_size for f in files}, budget)   # (dicts keep the files' order)
    if kit_dir.exists():
        shutil.rmtree(kit_dir)
    entries = {name: {"size": f.stat().st_size, "sha256": sha256_file(f), "parts": []} for name, f in by_name.items()}
    for n, call in enumerate(calls, 1):
        folder = kit_dir / f"call{n}"
        folder.mkdir(parents=True)
        for name, part, offset, length in call:
            with open(by_name[name], "rb") as src, open(folder / part, "wb") as dst:
                src.seek(offset)
                dst.write(src.read(length))
            entries[name]["parts"].append({"name": part, "call": n, "offset": offset, "size": length,
                                           "sha256": sha256_file(folder / part)})
    for e in entries.values():
        e["parts"].sort(key=lambda p: p["offset"])
    manifest = {"kit": hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()[:16],
                "calls": len(calls), "budget": budget, "files": entries}
    for n in range(1, len(calls) + 1):
        (kit_dir / f"call{n}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _manifests(kit_dir: Path) -> dict:
    found = {}
    for path in sorted(kit_dir.glob(f"call*/{MANIFEST}")):
        m = json.loads(path.read_text())
        found[m["kit"]] = m
    if not found:
        raise KitError(f"no {kit_dir}/callN/{MANIFEST} came with this call: name the kit's call folder in the run "
                       "call's carry (python benchmarks/gpu/prepare.py prints the sequence)")
    if len(found) > 1:
        raise KitError(f"parts of {len(found)} different kits in {kit_dir} ({', '.join(found)}): run prepare.py "
                       "once and carry only its folders")
    return next(iter(found.values()))


def stage(kit_dir: Path, state: Path) -> dict:
    """Check each part that came in kit_dir against the manifest and copy it to STATE/parts/KIT (over a copy
    staged before: carrying a part again mends a bad one); returns
    {"kit", "calls", "have": [call numbers complete], "missing": [...]}; a part whose sha256 differs is a
    KitError naming it."""
    manifest = _manifests(kit_dir)
    parts = state / "parts" / manifest["kit"]
    parts.mkdir(parents=True, exist_ok=True)
    (parts / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for entry in manifest["files"].values():
        for p in entry["parts"]:
            src = kit_dir / f"call{p['call']}" / p["name"]
            if not src.exists():   # carried by another call
                continue
            _check(src, p, f"carried part {src}")
            tmp = parts / (p["name"] + ".tmp")
            shutil.copyfile(src, tmp)
            tmp.rename(parts / p["name"])
    return progress(state, manifest)


def progress(state: Path, manifest: dict) -> dict:
    parts = state / "parts" / manifest["kit"]
    every = [p for e in manifest["files"].values() for p in e["parts"]]
    missing = sorted({p["call"] for p in every if not (parts / p["name"]).exists()})
    return {"kit": manifest["kit"], "calls": manifest["calls"],
            "have": [n for n in range(1, manifest["calls"] + 1) if n not in missing], "missing": missing}


def _check(path: Path, expected: dict, what: str) -> None:
    size = path.stat().st_size
    if size != expected["size"]:
        raise KitError(f"{what}: {size} bytes, the manifest says {expected['size']}: the copy was cut short; "
                       "carry it again, or re-run prepare.py here")
    digest = sha256_file(path)
    if digest != expected["sha256"]:
        raise KitError(f"{what}: sha256 {digest[:16]}..., the manifest says {expected['sha256'][:16]}...: the "
                       "file is corrupt; carry it again, or re-run prepare.py here")


def assemble(state: Path, dest: Path, patterns: list[str] | None = None) -> list[Path]:
    """The files of the staged kit (those matching one of `patterns`, shell-style; all by default), rebuilt in
    DEST from their parts, each part and each whole file checked by sha256; a KitError names the calls still
    missing or the file that does not match."""
    kits = sorted((state / "parts").glob(f"*/{MANIFEST}"), key=lambda p: p.stat().st_mtime)
    if not kits:
        raise KitError(f"nothing staged in {state}/parts: this machine is fresh (a machine goes back 30 s after "
                       "a call); make the kit's calls again from call 1, back to back")
    manifest = json.loads(kits[-1].read_text())   # the newest kit staged
    wanted = {name: entry for name, entry in manifest["files"].items()
              if patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    if not wanted:
        raise KitError(f"kit {manifest['kit']} holds no file named like {' or '.join(patterns)} (it holds "
                       f"{', '.join(manifest['files'])}): re-run prepare.py here")
    parts = state / "parts" / manifest["kit"]
    missing = sorted({p["call"] for e in wanted.values() for p in e["parts"] if not (parts / p["name"]).exists()})
    if missing:
        raise KitError(f"kit {manifest['kit']}: the parts of call(s) {missing} of {manifest['calls']} never arrived "
                       "on this machine: make those calls (carry .gpukit/callN), then assemble")
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name, entry in wanted.items():
        target = dest / name
        if target.exists() and target.stat().st_size == entry["size"] and sha256_file(target) == entry["sha256"]:
            out.append(target)
            continue
        tmp = dest / (name + ".tmp")
        with open(tmp, "wb") as dst:
            for p in entry["parts"]:
                _check(parts / p["name"], p, f"staged part {p['name']}")
                with open(parts / p["name"], "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 20)
        _check(tmp, entry, f"reassembled {name}")
        tmp.rename(target)
        out.append(target)
    return out


def main(argv: list[str]) -> int:
    usage = "usage: chunks.py stage KIT_DIR STATE_DIR | assemble STATE_DIR DEST_DIR [PATTERN ...]"
    if len(argv) < 3 or argv[0] not in ("stage", "assemble") or (argv[0] == "stage" and len(argv) != 3):
        print(usage, file=sys.stderr)
        return 2
    try:
        if argv[0] == "stage":
            s = stage(Path(argv[1]), Path(argv[2]))
            print(f"kit {s['kit']}: calls {s['have']} of {s['calls']} staged"
                  + (f"; still to come: calls {s['missing']}" if s["missing"] else "; complete"))
        else:
            for path in assemble(Path(argv[1]), Path(argv[2]), argv[3:] or None):
                print(f"{path.name}: sha256 checked")
    except KitError as e:
        print(f"gpukit: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
