"""The package's layers import one way: every import in modelcache/ — function-local ones too — reaches
its own layer or a lower one, and no two modules import each other (directly or round a loop). The
package stands alone: it never imports the lab (benchmarks/) or the tests, and only the CLI reaches into
modelcache.bench (the demo and the benchmarks share modelcache.measure).

The table is docs/internals.md's ("The layers"), bottom to top. A module not in it fails the test: a new
module gets a place on purpose, not by accident.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "modelcache"

# Bottom to top; an entry names a module or a whole subpackage.
LAYERS = [
    ("foundation", ["errors", "storage", "cuda", "session_options", "histogram", "calibration", "plotting",
                    "usage", "memlimit", "triton_protos"]),
    ("wire", ["wire"]),
    ("settings", ["config", "address"]),
    ("store", ["store"]),
    ("model tooling", ["zoo"]),
    ("tiers", ["tiers", "eviction"]),
    ("executor", ["executor"]),
    ("daemon", ["daemon"]),
    ("client", ["client"]),
    ("fronts", ["placement", "oip", "http", "grpc", "triton_repo", "cluster", "measure", "bench", "demo"]),
    ("command line", ["cli"]),
]
# Kept on purpose, each for a reason docs/internals.md gives.
ALLOWED = {
    # address.py resolves the socket from the settings only when none is given: the attach path imports
    # address without loading the settings machinery (docs/internals.md, "The layers").
    ("address", "config"),
}
# The client imports nothing of the daemon, the executor or the planner: a function process stays small.
FORBIDDEN = {"client": {"daemon", "executor", "placement"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported_names(name: str, path: Path, modules: dict) -> set[str]:
    """Every module name `name` imports, anywhere in its body (function-local imports included); a name
    imported from a package module counts as that module, or as the package's submodule of that name."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - (node.level - 1) - (0 if is_package else 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.update(f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names)
    return found


def imports_of(name: str, path: Path, modules: dict) -> set[str]:
    """Every package module `name` imports, anywhere in its body (function-local imports included)."""
    found = set()
    for target in imported_names(name, path, modules):
        if target == "modelcache" or not target.startswith("modelcache."):
            continue   # the package's facade (`from modelcache import __version__`) or another package
        while target not in modules and "." in target:
            target = target.rsplit(".", 1)[0]
        if target != name:
            found.add(target)
    return found


def top_part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def layer_of(module: str) -> int:
    part = top_part(module)
    for i, (_, members) in enumerate(LAYERS):
        if part in members:
            return i
    raise AssertionError(f"{module} has no layer: give it a place in tests/test_layers.py and docs/internals.md's table")


def graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_every_import_reaches_its_own_layer_or_a_lower_one():
    upward = []
    for module, targets in graph().items():
        if module == "modelcache":
            continue   # the facade: its lazy __getattr__ hands out the client's names
        for target in targets:
            pair = (top_part(module), top_part(target))
            if pair in ALLOWED:
                continue
            if layer_of(target) > layer_of(module):
                upward.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                              f"({LAYERS[layer_of(target)][0]})")
            if top_part(target) in FORBIDDEN.get(top_part(module), ()):
                upward.append(f"{module} imports {target}: the client imports nothing of the daemon's side")
    assert not upward, "imports that run up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_loops():
    edges = graph()
    index, low, stack, on_stack, loops = {}, {}, [], set(), []
    counter = [0]

    def visit(v):   # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if (top_part(v), top_part(w)) in ALLOWED:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not loops, f"import loops: {loops}"


def test_the_checker_sees_function_local_imports(tmp_path):
    """The walk is what makes the two tests above mean something: an import inside a function counts."""
    modules = package_modules()
    assert "modelcache.daemon.server" in imports_of("modelcache.cli", PACKAGE / "cli.py", modules)


def test_the_package_never_imports_the_lab_or_the_tests():
    modules = package_modules()
    for name, path in modules.items():
        bad = {n for n in imported_names(name, path, modules) if n.split(".")[0] in ("benchmarks", "tests", "conftest")}
        assert not bad, f"{name} imports {sorted(bad)}"


def test_only_the_cli_reaches_into_bench():
    for module, targets in graph().items():
        if module == "modelcache.cli" or module.startswith("modelcache.bench"):
            continue
        bad = {t for t in targets if top_part(t) == "bench"}
        assert not bad, f"{module} imports {sorted(bad)}: the product does not run on benchmark code"


# Methods that change a list, dict or set in place: `x.waiters.append(...)` writes x's field as surely as `=`.
MUTATORS = {"append", "remove", "clear", "pop", "popitem", "update", "setdefault", "add", "discard", "insert",
            "extend", "sort", "reverse", "__setitem__", "__delitem__"}


def record_writes(path: Path, fields: set) -> list[str]:
    """Every write in `path` to an attribute named in `fields` of an object other than `self`: an assignment
    (augmented, annotated, to an item of it, or a delete), a mutating call on it, or setattr with its name."""
    found = []

    def own(node) -> bool:
        """`self`, or what `self` holds whole (its record's manifest: self.manifest)."""
        if isinstance(node, ast.Attribute) and node.attr == "manifest":
            node = node.value
        return isinstance(node, ast.Name) and node.id == "self"

    def field_of(node):
        while isinstance(node, ast.Subscript):     # x.field[k] = ...: the field is written
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in fields and not own(node.value):
            return ast.unparse(node)
        return None

    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                targets = [func.value]
            elif isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in fields:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                written = field_of(part)
                if written:
                    found.append(f"{path.name}:{node.lineno}: {written}")
    return found


def test_record_fields_change_only_through_the_records_own_methods():
    """A model's record (with its manifest) and its copy in each tier own their transitions (daemon/registry.py,
    daemon/residency/copy.py): no other code writes their fields. Records live in the daemon (no layer below
    imports it, and the fronts see only the wire's dicts), so its modules are the ones that could; the records'
    own writes are all to `self.` or to `self.manifest.`."""
    from dataclasses import fields

    from modelcache.daemon.registry import ModelRecord
    from modelcache.daemon.residency import TierCopy
    from modelcache.store.format import Manifest
    names = {f.name for cls in (ModelRecord, TierCopy, Manifest) for f in fields(cls)}
    assert {"state", "holds", "holders", "waiters", "pinned", "hits", "damage", "tier_copies", "stages",
            "batching", "checksum", "files"} <= names
    writes = [w for path in sorted((PACKAGE / "daemon").rglob("*.py")) for w in record_writes(path, names)]
    assert not writes, "record fields written outside the record's methods:\n" + "\n".join(writes)


def test_the_record_check_sees_each_kind_of_write(tmp_path):
    """What makes the test above mean something: each way of writing a field is caught."""
    module = tmp_path / "writes.py"
    module.write_text("def f(model, copy, key):\n    model.pinned = True\n    copy.holds += 1\n"
                      "    copy.waiters.append(key)\n    model.tier_copies[key] = None\n    setattr(model, 'hits', 1)\n"
                      "    del model.tier_copies[key]\n    model.manifest.stages = []\n    self.state = 1\n"
                      "    self.manifest.stages = []\n")
    assert len(record_writes(module, {"pinned", "holds", "waiters", "tier_copies", "hits", "state", "stages"})) == 7


def test_a_function_process_imports_little_beyond_numpy_and_onnxruntime_to_open_a_model():
    """A FaaS cold start pays every import of the attach path (modelcache.InferenceSession: the drop-in session,
    the lease client, the wire). Beside numpy and onnxruntime, which every ORT process imports, it adds no part
    of the daemon and neither logging nor shutil (~10 ms of a fresh process's imports, `python -X importtime`:
    storage.py imports them where they are used)."""
    import subprocess
    import sys
    probe = ("import sys, numpy, onnxruntime\nbefore = set(sys.modules)\n"
             "import modelcache.client.session, modelcache.client.leases\n"
             "print(' '.join(sorted(set(sys.modules) - before)))")
    added = set(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                               cwd=PACKAGE.parent).stdout.split())
    assert "modelcache.client.session" in added
    heavy = sorted(m for m in added if m in ("logging", "shutil", "dataclasses") or m.startswith(
        ("modelcache.daemon", "modelcache.executor", "modelcache.store", "modelcache.placement", "zmq")))
    assert not heavy, f"the attach path imports {heavy}"
