"""Conformance: what plain ONNX Runtime runs, modelcache adds and runs, with the same outputs.

The corpus is the ONNX backend test suite that the installed `onnx` package defines (generated
from it, not vendored): ~1,900 single-operator cases (`node`) and the model cases its wheel ships
(`simple`, `pytorch-converted`, `pytorch-operator`). Each case runs

1. through plain ORT (CPU) on its own inputs: that is the reference, not the case's expected
   outputs (the rule is "same as ORT", whatever ORT computes);
2. through one daemon: `add`, then the drop-in session in attach mode and in serve mode, each
   compared with (1) on outputs (dtype, shape, values; NaN equals NaN) and on input metadata.

A case plain ORT cannot build or run is "ort-refuses": modelcache must then refuse too, with an
error rather than a crash or a hang. Usage: `modelcache bench conformance --help`.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from ..usage import Parser

KINDS = ("node", "simple", "pytorch-converted", "pytorch-operator")


@dataclass
class Case:
    name: str
    kind: str
    model: object                 # onnx.ModelProto
    feeds: dict                   # input name -> value (numpy array, list for sequences, None for optional)
    rtol: float = 1e-3
    atol: float = 1e-7


@dataclass
class Result:
    case: str
    kind: str
    outcome: str                  # pass | ort-refuses | fail
    detail: dict = field(default_factory=dict)   # mode -> first line of what went wrong


def load_cases(kinds=KINDS, sample: int | None = None, seed: int = 0) -> list[Case]:
    """The corpus's cases of these kinds (a seeded random sample of `sample` of them), first data set each."""
    import onnx
    from onnx import numpy_helper
    from onnx.backend.test.loader import load_model_tests

    with warnings.catch_warnings():  # generating the node cases warns about the overflows they test
        warnings.simplefilter("ignore")
        tests = [t for kind in kinds for t in load_model_tests(kind=kind)]
    tests.sort(key=lambda t: t.name)
    if sample is not None and sample < len(tests):
        tests = sorted(random.Random(seed).sample(tests, sample), key=lambda t: t.name)
    cases = []
    for t in tests:
        if t.model is not None:
            model, inputs = t.model, (t.data_sets[0][0] if t.data_sets else [])
        else:  # shipped as files: model.onnx and test_data_set_0/input_N.pb
            model = onnx.load(str(Path(t.model_dir) / "model.onnx"))
            data = sorted((Path(t.model_dir) / "test_data_set_0").glob("input_*.pb"),
                          key=lambda p: int(p.stem.split("_")[1]))
            inputs = [numpy_helper.to_array(onnx.load_tensor(str(p))) for p in data]
        init = {i.name for i in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in init]
        feeds = {n: (np.asarray(v) if isinstance(v, np.generic) else v) for n, v in zip(names, inputs)}
        cases.append(Case(t.name, t.kind, model, feeds, getattr(t, "rtol", 1e-3), getattr(t, "atol", 1e-7)))
    return cases


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def _same(got, want, rtol: float, atol: float) -> str | None:
    """None when `got` equals `want` as plain ORT returned it; else what differs."""
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return f"sequence of {len(want)} expected, got {type(got).__name__}"
        return next((d for d in (_same(g, w, rtol, atol) for g, w in zip(got, want)) if d), None)
    if want is None:
        return None if got is None else f"None expected, got {type(got).__name__}"
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{want.dtype}{list(want.shape)} expected, got {got.dtype}{list(got.shape)}"
    if want.dtype == object or want.dtype.kind in "USb":
        return None if got.tolist() == want.tolist() else "values differ"
    if not np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True):
        return f"values differ (max abs diff {np.nanmax(np.abs(got.astype(np.float64) - want)):.3g})"
    return None


def run_case(client, case: Case, workdir: Path) -> Result:
    """One case through plain ORT, then add + attach + serve; see the module's docstring."""
    import onnx
    import onnxruntime as ort
    import modelcache

    path = workdir / f"{case.name}.onnx"
    onnx.save(case.model, str(path))
    try:
        plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        want = plain.run(None, case.feeds)
    except Exception as e:
        return _refused_too(client, case, path, _first_line(e))
    detail = {}
    try:
        client.add(str(path), case.name)
    except Exception as e:
        return Result(case.name, case.kind, "fail", {"add": _first_line(e)})
    for mode in ("attach", "serve"):
        try:
            session = modelcache.InferenceSession(case.name, client=client, mode=mode)
            meta = [(i.name, i.shape) for i in session.get_inputs()]
            if meta != [(i.name, i.shape) for i in plain.get_inputs()]:
                detail[mode] = f"get_inputs() {meta} != ORT's {[(i.name, i.shape) for i in plain.get_inputs()]}"
                continue
            got = session.run(None, case.feeds)
            diff = _same(list(got), list(want), case.rtol, case.atol)
            if diff:
                detail[mode] = diff
        except Exception as e:
            detail[mode] = _first_line(e)
    return Result(case.name, case.kind, "fail" if detail else "pass", detail)


def _refused_too(client, case: Case, path: Path, ort_says: str) -> Result:
    """ORT refused the case: modelcache must refuse it too (at add, or at run), with an error."""
    import modelcache

    try:
        client.add(str(path), case.name)
        modelcache.InferenceSession(case.name, client=client).run(None, case.feeds)
    except Exception as e:
        return Result(case.name, case.kind, "ort-refuses", {"ort": ort_says, "modelcache": _first_line(e)})
    return Result(case.name, case.kind, "fail", {"ort": ort_says, "modelcache": "ran what ORT refuses"})


def run(client, cases: list[Case], workdir: Path, progress=None) -> list[Result]:
    results = []
    for i, case in enumerate(cases):
        results.append(run_case(client, case, workdir))
        if progress:
            progress(i + 1, len(cases), results[-1])
    return results


def summarize(results: list[Result]) -> dict:
    counts = collections.Counter(r.outcome for r in results)
    by_mode = collections.Counter(m for r in results if r.outcome == "fail" for m in r.detail)
    reasons = collections.Counter(f"{m}: {why.split(' (')[0][:120]}" for r in results if r.outcome == "fail"
                                  for m, why in r.detail.items())
    return {"cases": len(results), **{k: counts.get(k, 0) for k in ("pass", "ort-refuses", "fail")},
            "failures_by_mode": dict(by_mode), "top_reasons": reasons.most_common(20)}


def main(argv: list[str]) -> int:
    from ..measure import managed_daemon
    from ..client.connection import connect

    ap = Parser(prog="modelcache bench conformance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"corpus parts, comma-separated (default: all of {KINDS})")
    ap.add_argument("--sample", type=int, default=None, help="a seeded random sample of this many cases (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/conformance", help="where results.json and summary.json go")
    args = ap.parse_args(argv)
    cases = load_cases(tuple(args.kinds.split(",")), args.sample, args.seed)
    print(f"{len(cases)} cases from {args.kinds}", flush=True)
    t0 = time.monotonic()

    def progress(done, total, r):
        if r.outcome == "fail":
            print(f"  FAIL {r.case}: {r.detail}", flush=True)
        if done % 100 == 0 or done == total:
            print(f"  {done}/{total} in {time.monotonic() - t0:.0f} s", flush=True)

    with tempfile.TemporaryDirectory(prefix="modelcache-conformance-") as tmp:
        work = Path(tmp)
        with managed_daemon(socket=f"ipc://{work}/daemon.sock", repository=str(work / "repo")) as socket:
            with connect(socket, timeout_s=120) as client:
                results = run(client, cases, work, progress)
    summary = summarize(results)
    summary["seconds"] = round(time.monotonic() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0 if summary["fail"] == 0 else 1
