"""Who owns a copy's holds, read from the code (issue #45): two counts that a restructure should bring down.

    PYTHONPATH=. python benchmarks/restructure/callgraph.py [--tree DIR]

1. Call sites outside the residency manager (modelcache/daemon/residency*) that hold, release, free or
   pre-check a model's copy: every call in the daemon's code (modelcache/daemon/ and the executor it runs) of
   a method by one of those names made on a residency manager, a tier, the registry, a copy or the engine's
   callbacks, and every read of the engine's `device_holds`, listed with its line, so that each can be read.
2. Following one model through `when_resident`, traced: the model brought into the host tier and then a
   (simulated) GPU's, its loads landed; then a lease on each copy, granted and ended. Printed: the calls from
   the residency manager's code into the registry's (modelcache/daemon/registry.py, where a copy's record
   lived before #45) and back, each named, and all calls in the order they ran, side by side.

`--tree`: another checkout (e.g. the commit before, a `git worktree`), measured with its own package and its
own tests/daemon_parts.py (the daemon's parts wired by hand over a real host tier and the fake allocator).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

# Methods that take or end a hold on a copy, free one, or check beforehand whether one may be freed.
# (Before issue #45 and after it: the old names and the residency manager's new ones.)
COPY_CALLS = {"hold", "release", "let_go", "lease", "grant", "end", "drop_client", "evict", "give_back", "freed",
              "free_model", "check_freeable", "serve_holds", "device_lease",
              "close", "unclaimed", "hold_request", "also", "hold_for_worker", "worker_done", "worker_hold", "demote",
              "remove", "adopt", "adopted", "set_capacity", "check_unheld"}
# What such a call is made on, when it is a copy's: a residency manager (host, residency, r, a GPU's by_uuid[..]),
# a tier, the registry, a copy, the serving or engine object, or self (the engine's own callbacks). A socket's
# close, a queue's remove or a lock's release are made on other names.
RECEIVERS = {"self", "host", "residency", "r", "by_uuid", "tier", "registry", "copy", "serving", "engine"}
GENERIC = {"close", "remove", "end"}     # (on self: a child process's close, say, not a copy's)
# Of those, the calls that touch a copy's holds or free its memory by hand, not through an operation of its
# residency manager: the registry's lease table, a copy's own counts, a tier's free, the engine's own holds.
RAW = {"hold", "release", "let_go", "lease", "freed", "free_model", "check_freeable", "serve_holds", "device_lease",
       "device_holds", "grant", "drop_client"}


def is_residency(path: str) -> bool:
    return "/daemon/residency" in path


def call_sites(package: Path) -> list[str]:
    """Each call of a COPY_CALLS method in the daemon's code outside the residency manager, and each read of
    the engine's `device_holds`. (The clients' own `release` of their sessions is not the daemon's.)"""
    found = []
    paths = sorted(p for folder in ("daemon", "executor") for p in (package / folder).rglob("*.py"))
    for path in paths:
        if is_residency(str(path)):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COPY_CALLS:
                receiver = re.sub(r"\[.*\]$", "", ast.unparse(node.func.value)).split(".")[-1]
                if receiver in RECEIVERS and not (receiver == "self" and node.func.attr in GENERIC):
                    name = ast.unparse(node.func)
            elif isinstance(node, ast.Attribute) and node.attr == "device_holds":
                name = ast.unparse(node)
            if name:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {name}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


TRACE = r'''
import sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import daemon_parts
from daemon_parts import Parts, resident

calls = []
def profile(frame, event, arg):
    if event == "call":
        path = frame.f_code.co_filename
        if "/modelcache/daemon/" in path:
            caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
            caller = caller.split("/modelcache/daemon/")[1] if "/modelcache/daemon/" in caller else "-"
            calls.append((path.split("/modelcache/daemon/")[1], frame.f_code.co_name, caller))

with tempfile.TemporaryDirectory() as tmp:
    parts = Parts(Path(tmp))
    model = parts.add(Path(tmp), "tiny-cnn", "m")
    client = parts.registry.new_client(0, "trace", parts.clock())
    sys.setprofile(profile)
    resident(parts, model, parts.device)
    sys.setprofile(None)
    print("when_resident")
    for call in calls:
        print(*call)
    calls.clear()
    sys.setprofile(profile)
    for residency in (parts.residency, parts.device):
        parts.release(parts.lease(client, model, residency))
    sys.setprofile(None)
    print("lease")
    for call in calls:
        print(*call)
    parts.stop()
'''


def trace(tree: Path) -> dict:
    """The daemon's calls, in `tree`'s own code, while one model is brought in ("when_resident"), then while a
    lease on each of its copies is granted and ended ("lease")."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", TRACE], cwd=tree, env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    phases: dict = {}
    for line in out.splitlines():
        if " " not in line:
            phase = phases.setdefault(line, [])
        else:
            phase.append(tuple(line.split(" ")))
    return phases


def side_of(module: str) -> str | None:
    return "residency" if is_residency("/daemon/" + module) else "registry" if module == "registry.py" else None


def crossings(calls: list) -> tuple[list, list]:
    """The calls that cross from the residency manager's code into the registry's, or back (function names),
    and the runs of calls on each side (calls of other modules do not count)."""
    crossing = [f"{side_of(caller)} -> {function}" for module, function, caller in calls
                if {side_of(module), side_of(caller)} == {"residency", "registry"}]
    runs: list = []
    for module, function, _ in calls:
        side = "residency" if is_residency("/daemon/" + module) else "registry" if module == "registry.py" else None
        if side is None:
            continue
        if runs and runs[-1][0] == side:
            runs[-1][1].append(function)
        else:
            runs.append((side, [function]))
    return crossing, runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=Path("."), help="the checkout to read (default: this one)")
    args = ap.parse_args()
    tree = args.tree.resolve()
    sites = call_sites(tree / "modelcache")
    raw = [site for site in sites if site.rsplit(".", 1)[-1] in RAW and ".registry." in site
           or site.rsplit(".", 1)[-1] in RAW - {"grant", "drop_client"}]
    print(f"{len(sites)} calls outside the residency manager hold, release, free or pre-check a copy; "
          f"{len(raw)} of them by hand (the registry's lease table, a copy's counts, a tier's free, the engine's "
          f"own holds: marked *), the rest through an operation of the copy's residency manager:")
    for site in sites:
        print(("* " if site in raw else "  ") + site)
    phases = trace(tree)
    for phase, what in (("when_resident", "one model through when_resident (host, then GPU)"),
                        ("lease", "a lease on each of its copies, granted and ended")):
        crossing, runs = crossings(phases[phase])
        print(f"\n{what}: {len(crossing)} calls between the residency manager and the registry: "
              f"{', '.join(crossing)}")
        for side, functions in runs:
            print(f"  {side:9} {' '.join(functions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
