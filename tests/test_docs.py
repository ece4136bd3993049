"""The docs cannot drift from the code. In README.md, docs/*.md and benchmarks/README.md: every `modelcache ...`
command parses with the real command line, every lab script they run takes the options they give it, every
relative link and every repository path they name exists, the settings table names every setting, and the
README stays a five-minute read.

Which commands: each line of a shell code block (fenced ```sh, ```bash, ```shell or ```console, or indented by
four spaces; program output goes in ```text) and each inline code span, split at `&&`, `;`, `|` and `&`. A
piece whose first word, after `VAR=value` assignments and `sudo`, is `modelcache` is a command; `# comments`
are dropped, and a line ending in a backslash joins the next.

How a command is checked, without running anything: `modelcache.cli.build_parser()` must parse it (a `--help`
line too: argparse prints the help and exits 0), with every option spelled out (argparse alone would take
`--stage` for `--stages`). `modelcache bench NAME ARGS` goes one step further: ARGS must parse with NAME's own
parser, which modelcache.bench.NAME.main builds and parses first thing; here its parse_args stops main right
after parsing. A lab script a doc runs (`python benchmarks/X/Y.py ARGS`, `python -m benchmarks.X.Y ARGS`)
must exist and, where it has an argparse parser, take ARGS the same way.

The placeholder rule:
- `[...]` is an optional part: the command is checked both without it and with its contents (`verify [NAME]`).
- `...` stands for "and more" and is dropped; `modelcache` with nothing after it names no command (skipped).
- An all-capitals word (NAME, FILE, DIR, REPO, V, N, UUID, ...) is a placeholder and becomes its sample value
  in PLACEHOLDERS; in the command's place (`modelcache COMMAND --help`) it stands for every command, and as
  the benchmark's name (`modelcache bench NAME`) for every benchmark. A capital word not in PLACEHOLDERS
  fails the test: add it there, or write a real value. A setting's environment variable (MODELCACHE_...) is one.
- A command with a `<...>` in it (`benchmarks/<name>/run.py`) is a pattern, not a command: skipped.
- An inline span may leave out required arguments (prose names `modelcache add --prepack` for its option);
  everything it does give must parse. A code block's command must be complete.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import io
import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
PLACEHOLDERS = {"NAME": "resnet50", "FILE": "model.onnx", "PATH": "model.onnx", "DIR": "out", "REPO": "models",
                "V": "1", "N": "2", "K": "2", "UUID": "GPU-0", "INDEX": "0", "HOST": "127.0.0.1", "PORT": "8000",
                "OUT": "out", "SOCKET": "ipc:///tmp/mc/daemon.sock", "MODEL": "resnet50", "CHECKOUT": "."}
SHELL_LANGS = {"sh", "bash", "shell", "console"}
NOT_OURS = {"model.py"}   # names of other projects' files the docs mention (Triton's Python backend)


class Refused(Exception):
    """A parser refused a command line: argparse's own message."""


class Parsed(Exception):
    """A benchmark's parser accepted its arguments: main stops here, before it runs anything."""


# --- reading the docs -------------------------------------------------------------------------------------

def code_blocks(text: str):
    """(language, lines) of each fenced or indented code block."""
    lines, i, prose_before = text.splitlines(), 0, True
    while i < len(lines):
        fence = re.match(r"^\s*```\s*(\w*)", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), len(lines))
            yield fence.group(1), lines[i + 1:end]
            i, prose_before = end + 1, False
        elif lines[i].startswith("    ") and prose_before and lines[i].strip():
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            yield "sh", [line[4:] for line in lines[i:end]]
            i, prose_before = end, True
        else:
            prose_before = not lines[i].strip()
            i += 1


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^\s*```.*?^\s*```[^\n]*$", "", text, flags=re.S | re.M)


def inline_spans(text: str) -> list[str]:
    return [" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`]+)`(?!`)", prose(text))]


def shell_lines(block: list[str]) -> list[str]:
    joined, out = "", []
    for line in block:
        if line.rstrip().endswith("\\"):
            joined += line.rstrip()[:-1] + " "
            continue
        out.append(joined + line)
        joined = ""
    return out


def pieces(line: str) -> list[list[str]]:
    """A shell line's simple commands, each as its words (quotes removed, comments dropped)."""
    lexer = shlex.shlex(line.lstrip("$ "), posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    words, out = list(lexer), [[]]
    for word in words:
        if word in ("&&", "&", "||", "|", ";"):
            out.append([])
        else:
            out[-1].append(word)
    return [p for p in out if p]


def command_words(words: list[str]) -> list[str]:
    """The words after `VAR=value ...` and `sudo`."""
    while words and (re.match(r"^[A-Za-z_]\w*=", words[0]) or words[0] == "sudo"):
        words = words[1:]
    return words


def commands(path: Path):
    """(where, words, complete) for each command of one doc."""
    text, name = path.read_text(), path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for lang, block in code_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        for line in shell_lines(block):
            try:
                found = pieces(line)
            except ValueError:   # an unbalanced quote: no shell line, so it must not hold a command
                assert not re.search(r"(^|[;&|]\s*)modelcache\s", line), f"{name}: cannot read {line!r}"
                continue
            for words in found:
                yield f"{name}: {line.strip()}", command_words(words), True
    for span in inline_spans(text):
        try:
            for words in pieces(span):
                yield f"{name}: `{span}`", command_words(words), False
        except ValueError:
            continue


def variants(words: list[str]) -> list[list[str]]:
    """Each way of reading the optional [...] parts: without each, and with its contents."""
    text = " ".join(words)
    groups = re.findall(r"\[([^\[\]]*)\]", text)
    out = []
    for keep in itertools.product((False, True), repeat=len(groups)):
        it = iter(keep)
        out.append(re.sub(r"\[([^\[\]]*)\]", lambda m: m.group(1) if next(it) else "", text).split())
    return out


def substitute(words: list[str], where: str) -> list[str]:
    out = []
    for word in words:
        if word == "...":
            continue
        for cap in re.findall(r"\b[A-Z][A-Z_]*\b", word):
            if cap not in PLACEHOLDERS and not cap.startswith("MODELCACHE_"):   # (a setting's variable: real)
                raise AssertionError(f"{where}: {cap!r} reads as a placeholder: add it to PLACEHOLDERS in "
                                     "tests/test_docs.py or write a real value")
        out.append(re.sub(r"\b[A-Z][A-Z_]*\b", lambda m: PLACEHOLDERS.get(m.group(0), m.group(0)), word))
    return out


def modelcache_commands():
    for doc in DOCS:
        for where, words, complete in commands(doc):
            if words[:1] != ["modelcache"] or any("<" in w for w in words):
                continue
            for v in variants(words[1:]):
                if v and v != ["..."]:
                    yield where, v, complete


def lab_commands():
    for doc in DOCS:
        for where, words, _ in commands(doc):
            if not words or not re.match(r"^(python3?|\S*/bin/python3?)$", words[0]) or any("<" in w for w in words):
                continue
            rest = [w for w in words[1:] if w not in ("-I", "-u")]
            if rest[:1] == ["-m"] and rest[1].startswith("benchmarks."):
                yield where, rest[1], rest[2:]
            elif rest and rest[0].startswith("benchmarks/") and rest[0].endswith(".py"):
                yield where, rest[0][:-3].replace("/", "."), rest[1:]


# --- parsing without running ------------------------------------------------------------------------------

@contextlib.contextmanager
def refusals_raise():
    """argparse's error() raises Refused (with its message) instead of exiting; --help still exits 0. Options
    must be spelled out: argparse takes `--stage` for `--stages`, a doc should not."""
    from modelcache.usage import Parser

    def error(self, message):
        raise Refused(f"{self.prog}: {message}")
    saved = (argparse.ArgumentParser.error, Parser.error, argparse.ArgumentParser._get_option_tuples)
    argparse.ArgumentParser.error = Parser.error = error
    argparse.ArgumentParser._get_option_tuples = lambda self, option_string: []   # no abbreviated options
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        argparse.ArgumentParser.error, Parser.error, argparse.ArgumentParser._get_option_tuples = saved


@contextlib.contextmanager
def parse_only():
    """parse_args parses, then stops whatever called it (a script's main) with Parsed."""
    saved = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(saved(self, args, namespace))
    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = saved


def exits_zero(call) -> bool:
    """Run call; True if it stopped at a --help (exit 0), False if it parsed (Parsed)."""
    try:
        call()
    except Parsed:
        return False
    except SystemExit as e:
        if e.code in (0, None):
            return True
        raise
    raise AssertionError("returned without parsing its arguments")


def check_script_args(main, argv: list[str]) -> None:
    """Parse argv with the parser `main` builds, stopping main there."""
    takes_argv = bool(inspect.signature(main).parameters)
    saved_argv = sys.argv
    sys.argv = ["script", *argv]
    try:
        with refusals_raise(), parse_only():
            exits_zero(lambda: main(argv) if takes_argv else main())
    finally:
        sys.argv = saved_argv


def check_modelcache(argv: list[str]) -> None:
    from modelcache.cli import BENCHMARKS, build_parser
    with refusals_raise():
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"exit {e.code}"
            return
    if getattr(args, "cmd", None) == "bench":
        assert args.which in BENCHMARKS
        check_script_args(importlib.import_module(f"modelcache.bench.{args.which}").main, args.rest)


def expand_names(words: list[str]) -> list[list[str]]:
    """COMMAND (the subcommand's place) stands for every command, NAME after `bench` for every benchmark."""
    from modelcache.cli import BENCHMARKS, build_parser
    if words[:1] == ["COMMAND"]:
        subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        return [w for name in subparsers.choices for w in expand_names([name, *words[1:]])]
    if words[:1] == ["bench"] and len(words) > 1 and re.fullmatch(r"[A-Z]+", words[1]):
        return [["bench", name, *words[2:]] for name in BENCHMARKS]
    return [words]


# --- the tests --------------------------------------------------------------------------------------------

def test_every_modelcache_command_in_the_docs_parses():
    seen, failures = 0, []
    for where, words, complete in modelcache_commands():
        for argv in expand_names(words):
            seen += 1
            try:
                check_modelcache(substitute(argv, where))
            except (Refused, AssertionError) as e:
                if not complete and re.search(r"arguments? (are|is) required", str(e)):
                    continue
                failures.append(f"{where}\n    modelcache {' '.join(argv)}: {e}")
    assert seen > 50, f"only {seen} commands found: is the reader broken?"
    assert not failures, "\n".join(failures)


def test_every_lab_script_the_docs_run_exists_and_takes_its_options():
    sys.path.insert(0, str(ROOT))
    failures, seen = [], 0
    try:
        for where, module, argv in lab_commands():
            seen += 1
            path = ROOT / (module.replace(".", "/") + ".py")
            if not path.is_file():
                failures.append(f"{where}: no {path.relative_to(ROOT)}")
                continue
            if "parse_args(" not in path.read_text():
                continue   # a script without an argparse parser: that it exists is what we can check
            try:
                check_script_args(importlib.import_module(module).main, substitute(argv, where))
            except (Refused, AssertionError) as e:
                failures.append(f"{where}: {e}")
    finally:
        sys.path.remove(str(ROOT))
    assert seen > 10, f"only {seen} lab commands found: is the reader broken?"
    assert not failures, "\n".join(failures)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_between_the_docs_resolves():
    failures = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue   # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                failures.append(f"{doc.relative_to(ROOT)}: ({target}): no such file")
            elif anchor and path.suffix == ".md":
                anchors = {slug(h) for h in re.findall(r"^#+\s+(.*)$", prose(path.read_text()), re.M)}
                if anchor not in anchors:
                    failures.append(f"{doc.relative_to(ROOT)}: ({target}): no heading #{anchor} there")
    assert not failures, "\n".join(failures)


def tracked_names() -> set[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return {Path(f).name for f in files} or {p.name for p in ROOT.rglob("*") if ".venv" not in p.parts}


def test_every_repository_path_the_docs_name_in_code_exists():
    """A path in code (`modelcache/daemon/residency/`, `tiers/base.py`, `benchmarks/faas`) exists relative to
    the repository, the package or the doc's folder, where its first part is a folder there; a bare module file
    (`cuda.py`) exists somewhere in the repository. Placeholders (<...>, CAPITALS, *) are patterns: skipped."""
    names, failures = tracked_names(), []
    for doc in DOCS:
        text = doc.read_text()
        words = [w for span in inline_spans(text) for w in span.split()]
        words += [w for lang, block in code_blocks(text) if lang != "python" for line in block
                  for w in (line.split("#")[0] if lang in SHELL_LANGS else line).split()]
        bases = [ROOT, ROOT / "modelcache", doc.parent]
        for word in words:
            word = word.strip("`'\",;:()").removeprefix("./")
            if (not word or re.search(r"[<>*{}$%\[\]]|\.\.\.|://|^/|^~|\b[A-Z]{2,}\b|^-", word)
                    or "=" in word):
                continue
            if "/" in word:
                first = word.split("/")[0]
                if any((base / first).is_dir() for base in bases) and first not in ("", ".."):
                    if not any((base / word).exists() for base in bases):
                        failures.append(f"{doc.relative_to(ROOT)}: {word}")
            elif re.fullmatch(r"\w+\.py", word) and word not in names | NOT_OURS:
                failures.append(f"{doc.relative_to(ROOT)}: {word}")
    assert not failures, "paths named in the docs that do not exist:\n" + "\n".join(sorted(set(failures)))


def test_the_settings_table_names_every_setting_and_no_other():
    from modelcache.config import Settings
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \|", text, re.M))
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert fields - rows == set(), f"settings missing from docs/operations.md's table: {sorted(fields - rows)}"
    assert rows - fields == set(), f"rows in docs/operations.md's table that are no setting: {sorted(rows - fields)}"


def test_the_layer_table_in_internals_is_the_one_test_layers_enforces():
    spec = importlib.util.spec_from_file_location("layers_under_test", ROOT / "tests" / "test_layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    text = (ROOT / "docs" / "internals.md").read_text()
    table = text[text.index("| layer (bottom to top) |"):].split("\n\n")[0].splitlines()[2:]
    documented = [(cells[1].strip(), sorted(m.rstrip("/") for m in re.findall(r"`([\w/]+)`", cells[2])))
                  for cells in (row.split("|") for row in table)]
    assert documented == [(name, sorted(members)) for name, members in layers.LAYERS]


def test_the_readme_is_a_five_minute_read_with_the_two_commands_ci_runs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "pip install -e . && modelcache demo" in text
    assert "pip install -e '.[test]' && python -m pytest -q" in text   # .ci/run greps this line and runs it
    assert "python -m pytest -q -m slow -n0" in text                    # what the default run leaves out


@pytest.mark.parametrize("line, error", [
    ("modelcache ad model.onnx --name x", "invalid choice: 'ad'"),
    ("modelcache add model.onnx --name x --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("modelcache bench soak --no-such-flag", "unrecognized arguments: --no-such-flag"),
    ("modelcache bench nosuch", "invalid choice: 'nosuch'"),
    ("modelcache calibrate resnet50 --run 3", "unrecognized arguments: --run 3"),   # (argparse alone takes it)
])
def test_a_command_that_does_not_exist_is_refused(line, error):
    """The checker itself: a wrong subcommand, option or benchmark fails (so the test above can fail)."""
    with pytest.raises(Refused, match=re.escape(error)):
        check_modelcache(shlex.split(line)[1:])


def test_the_reader_finds_commands_in_blocks_and_spans_and_reads_placeholders(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("Run `modelcache verify [NAME]`.\n\n```sh\nMODELCACHE_X=1 modelcache daemon &  # bg\n"
                   "pip install -e . && modelcache load NAME \\\n  --tier gpu:UUID\n```\n\n"
                   "    PYTHONPATH=. python benchmarks/faas/sweep.py --out DIR\n")
    found = [(w, c) for _, w, c in commands(doc)]
    assert (["modelcache", "daemon"], True) in found
    assert (["modelcache", "load", "NAME", "--tier", "gpu:UUID"], True) in found
    assert (["modelcache", "verify", "[NAME]"], False) in found
    assert (["python", "benchmarks/faas/sweep.py", "--out", "DIR"], True) in found
    assert variants(["verify", "[NAME]"]) == [["verify"], ["verify", "NAME"]]
    assert substitute(["load", "NAME", "--tier", "gpu:UUID", "..."], "x") == ["load", "resnet50", "--tier", "gpu:GPU-0"]
    with pytest.raises(AssertionError, match="placeholder"):
        substitute(["load", "WHATEVER"], "x")
