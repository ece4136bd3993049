"""The installed package stands alone: it never imports the lab (benchmarks/) or the tests, and only the
fronts that run benchmarks (the CLI, the demo) reach into modelcache.bench. Every import is walked,
function-local ones too."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "modelcache"


def imports(path: Path) -> set[str]:
    """Absolute names of every module `path` imports, anywhere in the file."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.add(name)
            found.update(f"{name}.{a.name}" for a in node.names)
    return found


def test_the_package_never_imports_the_lab_or_the_tests():
    for path in PACKAGE.rglob("*.py"):
        bad = {n for n in imports(path) if n.split(".")[0] in ("benchmarks", "tests", "conftest")}
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)}"


def test_only_the_cli_and_the_demo_reach_into_bench():
    allowed = {PACKAGE / "cli.py", PACKAGE / "demo.py"}
    for path in PACKAGE.rglob("*.py"):
        if path in allowed or path.parent == PACKAGE / "bench":
            continue
        bad = {n for n in imports(path) if n == "modelcache.bench" or n.startswith("modelcache.bench.")}
        assert not bad, f"{path.relative_to(PACKAGE.parent)} imports {sorted(bad)}"
