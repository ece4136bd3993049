"""Split a packed model into sequential stages at cuts where exactly one tensor crosses.

Cut candidates come from the skeleton's node order (ONNX graphs are topologically
sorted): between node i-1 and node i, the tensors produced before and consumed at or
after i must be a single activation. Where to cut among the candidates is decided by
measured cost: ORT's profiler times every node of the packed model, and cuts balance
the cumulative time (k equal stages) or leave a tail of a given share of it.

Stage skeletons are written beside the packed model and point at the same weights
blob, so stage sessions take their weights from the same shared memory: no copy per
stage. Every partition is checked before it is kept: stage by stage must give the
whole model's outputs.

A model with a GPU skeleton is cut at the same tensors there too (`stage-K.gpu.onnx`, the
stubs serve-mode GPU workers override with the GPU tier's device memory). Where the GPU
graph has no single-tensor cut at one of them (its optimizations differ from the CPU
graph's), the model's stages run on CPU workers only, as the log says.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

import logging

from ..errors import PackError
from ..storage import remove_tree, write_atomic
from ..store import integrity
from ..store.format import SKELETON_FILE, WEIGHTS_FILE, iter_graphs, load_manifest, write_manifest

log = logging.getLogger("modelcache.executor")


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    """Every tensor a node reads, including outer-scope names its subgraphs use."""
    names = {n for n in node.input if n}
    for attr in node.attribute:
        subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in subgraphs:
            for sub in iter_graphs(g):
                local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
                for n in sub.node:
                    local |= set(n.output)
                for n in sub.node:
                    names |= {i for i in n.input if i and i not in local}
    return names


def crossing_tensors(model: onnx.ModelProto) -> list[list[str]]:
    """For each boundary i (before node i, 0 < i < n): the non-initializer tensors alive across it."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    nodes = list(g.node)
    produced_at = {i.name: -1 for i in g.input if i.name not in inits}
    last_use: dict[str, int] = {}
    for idx, node in enumerate(nodes):
        for name in _node_inputs(node):
            last_use[name] = idx
        for out in node.output:
            produced_at[out] = idx
    for out in g.output:
        last_use[out.name] = len(nodes)
    result = []
    for i in range(1, len(nodes)):
        result.append(sorted(t for t, p in produced_at.items() if p < i and last_use.get(t, -1) >= i))
    return result


def profile_node_costs(skeleton: Path, feeds: dict, runs: int = 3) -> dict[str, float]:
    """Microseconds per node name, from ORT's profiler over `runs` runs of the packed model."""
    import onnxruntime as ort
    from ..session_options import attach_session_options

    with tempfile.TemporaryDirectory() as tmp:
        so = attach_session_options()
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "profile")
        sess = ort.InferenceSession(str(skeleton), so, providers=["CPUExecutionProvider"])
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    costs: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            costs[name] = costs.get(name, 0.0) + float(e.get("dur", 0))
    return costs


def choose_cuts(cum: list[float], candidates: list[int], targets: list[float]) -> list[int]:
    """For each target share of total cost, the candidate boundary whose cumulative share is nearest."""
    total = cum[-1] or 1.0
    chosen = []
    for target in targets:
        best = min((c for c in candidates if c not in chosen and all(c > x for x in chosen)),
                   key=lambda c: abs(cum[c - 1] / total - target), default=None)
        if best is None:
            raise PackError("not enough single-tensor cut points for that many stages")
        chosen.append(best)
    return chosen


def _dtypes_of(model: onnx.ModelProto, names: set) -> dict:
    """Element types of many tensors with one shape inference (float where ORT's contrib ops hide them)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    known = {vi.name: vi.type.tensor_type.elem_type for vi in
             list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output)
             if vi.type.tensor_type.elem_type}
    return {n: known.get(n, onnx.TensorProto.FLOAT) for n in names}


def _dtype_of(model: onnx.ModelProto, name: str) -> int:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        if vi.name == name and vi.type.tensor_type.elem_type:
            return vi.type.tensor_type.elem_type
    return onnx.TensorProto.FLOAT  # ORT contrib ops hide types from onnx inference; checked by running


def build_stage(model: onnx.ModelProto, start: int, end: int, inputs: list[str], outputs: list[str],
                dtypes: dict[str, int]) -> onnx.ModelProto:
    g = model.graph
    nodes = list(g.node)[start:end]
    used = set()
    for n in nodes:
        used |= _node_inputs(n)
    graph_inputs = {i.name: i for i in g.input}
    graph_outputs = {o.name: o for o in g.output}

    def value_info(name, known):
        return known[name] if name in known else helper.make_tensor_value_info(name, dtypes[name], None)

    stage = helper.make_graph(
        nodes, f"{g.name}_stage_{start}_{end}",
        [value_info(n, graph_inputs) for n in inputs],
        [value_info(n, graph_outputs) for n in outputs],
        [t for t in g.initializer if t.name in used])
    out = helper.make_model(stage, opset_imports=model.opset_import, producer_name="modelcache.partition")
    out.ir_version = model.ir_version
    return out


PLAN_FILE = "placement-plan.json"   # the plan a partition was made from, beside the stages it made
MAX_STAGES = 64   # far more than a pipeline of worker groups can use; a count is checked before anything is built


def check_request(stages: int | None, tail_fraction: float | None) -> None:
    """Refuse a partition request that cannot be met (PackError says why), before any file is touched."""
    if tail_fraction is not None:
        if not 0.0 < tail_fraction < 1.0:   # (NaN fails this too)
            raise PackError(f"tail fraction {tail_fraction}: give a share of compute between 0 and 1")
    elif stages is None or not 1 <= stages <= MAX_STAGES:
        raise PackError(f"give --stages K (2 <= K <= {MAX_STAGES}; 1 removes a partition) or --tail-fraction F"
                        + (f", not {stages} stages" if stages is not None else ""))


def stage_io(model: onnx.ModelProto, bounds: list[int]) -> list[tuple[list, list]]:
    """(inputs, outputs) of each stage [bounds[k], bounds[k+1]): the non-initializer tensors it reads
    that an earlier stage (or the caller) made, and those it makes that a later stage or the caller
    needs. Any number of tensors may cross a boundary."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    nodes = list(g.node)
    graph_outputs = [o.name for o in g.output]
    made_in = {i.name: -1 for i in g.input if i.name not in inits}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for n in nodes[a:b]:
            for out in n.output:
                made_in[out] = k
    used_in: dict[str, set] = {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for n in nodes[a:b]:
            for name in _node_inputs(n):
                if name in made_in and made_in[name] != k:
                    used_in.setdefault(name, set()).add(k)
    last = len(bounds) - 2
    result = []
    for k in range(last + 1):
        ins = sorted(t for t, users in used_in.items() if k in users)
        outs = sorted(t for t, made in made_in.items() if made == k and (any(u > k for u in used_in.get(t, ()))))
        if k == last:
            outs = graph_outputs
        result.append((ins, outs))
    early = [t for t in graph_outputs if made_in.get(t, last) != last]
    if early:
        raise PackError(f"output {early[0]!r} is made before the last stage; serve mode returns the last stage's "
                        "outputs, so a plan must keep it there")
    return result


def check_plan(plan: dict, model: onnx.ModelProto, name: str) -> list[int]:
    """The stage bounds of a placement plan, once it is known to be for this model (PackError if not)."""
    nodes = [n.name for n in model.graph.node]
    planned = str(plan.get("model", "")).rsplit("@", 1)[0]
    if planned and planned != name:
        raise PackError(f"the plan is for model {planned!r}, not {name!r}")
    stages = plan.get("stages") or []
    bounds = [0] + [int(s["end"]) for s in stages]
    if plan.get("nodes") != len(nodes) or bounds[-1] != len(nodes) or any(
            nodes[s["start"]] != s.get("first_node") or nodes[s["end"] - 1] != s.get("last_node") for s in stages):
        raise PackError(f"the plan was searched for another graph ({plan.get('nodes')} nodes) than {name}'s "
                        f"packed skeleton ({len(nodes)} nodes): run `modelcache place` on this model again")
    if any(b >= c for b, c in zip(bounds, bounds[1:])) or [int(s["start"]) for s in stages] != bounds[:-1]:
        raise PackError("the plan's stages are not contiguous ranges of nodes")
    return bounds


def partition(model_dir: Path, stages: int | None = None, tail_fraction: float | None = None,
              feeds: dict | None = None, gpu: bool = False, plan: dict | None = None) -> dict:
    """Cut the packed model in `model_dir`; write stage skeletons and record them in the manifest.

    Returns the manifest's new `stages` entry list. `stages=1` removes a partition. With `gpu` (the
    daemon has GPU workers), cuts are taken where the GPU skeleton can be cut at the same tensor, when
    there are enough such places, and GPU stage skeletons are written too (see partition_gpu). A
    placement `plan` (`modelcache place`) gives the cuts and each stage's worker set instead; its GPU
    stages are written where the GPU skeleton can be cut at the plan's tensors.
    """
    import onnxruntime as ort
    from ..session_options import attach_session_options
    from ..wire.tensors import random_feeds

    if plan is None:
        check_request(stages, tail_fraction)
    manifest = load_manifest(model_dir)
    if stages == 1:
        manifest.stages, manifest.stage_cuts, manifest.batching = [], [], {}
        manifest.files = {f: r for f, r in manifest.files.items() if not f.startswith("stage-")}
        manifest.files.pop(PLAN_FILE, None)
        write_manifest(model_dir, manifest)
        _remove_unused(model_dir, set(), keep_plan=False)
        return {"stages": [], "files": manifest.files}
    skeleton = model_dir / SKELETON_FILE
    model = onnx.load(str(skeleton), load_external_data=False)
    nodes = list(model.graph.node)
    crossing = crossing_tensors(model)
    candidates = [i + 1 for i, c in enumerate(crossing) if len(c) == 1]
    gpu_cuts = _gpu_cut_tensors(model_dir, manifest) if gpu and plan is None else set()
    # The CPU graph's layout rewrites (NCHWc) rename most activations: only a tensor both graphs cut at
    # can pass between a CPU and a GPU stage. Prefer those cuts when they are enough. (A plan's cuts are
    # the plan's: partition_gpu below says whether the GPU skeleton can be cut there too.)
    common = [c for c in candidates if crossing[c - 1][0] in gpu_cuts]
    if common and (tail_fraction is not None or stages - 1 <= len(common)):
        candidates = common
    elif gpu and plan is None:
        gpu = False
        log.warning("%s: no %d places where the CPU and GPU graphs both cut at one tensor; its stages run on "
                    "CPU workers only", model_dir, 1 if tail_fraction is not None else stages - 1)
    feeds = feeds or random_feeds(manifest.io_summary()["inputs"])   # (the model's declared inputs)
    costs = profile_node_costs(skeleton, feeds)
    cum, acc = [], 0.0
    for n in nodes:
        acc += costs.get(n.name, 0.0)
        cum.append(acc)
    graph_inputs = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    graph_outputs = [o.name for o in model.graph.output]
    if plan is not None:
        bounds = check_plan(plan, model, manifest.name)
        io = stage_io(model, bounds)
        cut_tensors = [t for ins, _ in io[1:] for t in ins]
        dtypes = _dtypes_of(model, set(cut_tensors) | {t for _, outs in io for t in outs})
    else:
        if tail_fraction is not None:
            targets = [1.0 - tail_fraction]
        else:
            if stages - 1 > len(candidates):
                raise PackError(f"{stages} stages need {stages - 1} cut points; this model has {len(candidates)} "
                                "where a single tensor crosses")
            targets = [i / stages for i in range(1, stages)]
        cuts = choose_cuts(cum, candidates, targets)
        bounds = [0, *cuts, len(nodes)]
        cut_tensors = [crossing[c - 1][0] for c in cuts]
        dtypes = {t: _dtype_of(model, t) for t in cut_tensors}
        io = [(graph_inputs if s == 0 else [cut_tensors[s - 1]],
               graph_outputs if s == len(bounds) - 2 else [cut_tensors[s]]) for s in range(len(bounds) - 1)]
    # New stages are written beside the old ones, under names the old ones do not use, and the manifest's
    # rename is the one moment the model changes: a partition that fails anywhere before it (a check, a full
    # disk) leaves the model's current stages, files and manifest, as they were.
    generation = _free_generation(manifest)
    entries, pending, placed = [], [], []
    old_plan = _read_if_there(model_dir / PLAN_FILE)
    committed = False
    try:
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            ins, outs = io[s]
            stage_model = build_stage(model, a, b, ins, outs, dtypes)
            fname = _stage_file(s, generation)
            pending.append(model_dir / f"{fname}.new")
            onnx.save_model(stage_model, str(pending[-1]))
            tensors = sorted({t.name for t in stage_model.graph.initializer
                              if t.data_location == onnx.TensorProto.EXTERNAL})
            entries.append({"file": fname, "inputs": ins, "outputs": outs, "tensors": tensors,
                            "cost_share": (cum[b - 1] - (cum[a - 1] if a else 0.0)) / (cum[-1] or 1.0)})
            if plan is not None:   # where the plan runs it: dmda picks among these workers (daemon names)
                entries[-1]["workers"] = list(plan["stages"][s]["worker_names"])
        # Check: stage by stage gives the whole model's outputs, over the same shared weights.
        whole = ort.InferenceSession(str(skeleton), attach_session_options(), providers=["CPUExecutionProvider"])
        want = whole.run(None, feeds)
        data = dict(feeds)
        try:
            for e, path in zip(entries, pending):
                sess = ort.InferenceSession(str(path), attach_session_options(), providers=["CPUExecutionProvider"])
                data.update(zip(e["outputs"], sess.run(e["outputs"], {k: data[k] for k in e["inputs"]})))
        except Exception as exc:
            raise PackError(f"partition at {cut_tensors} does not run in ONNX Runtime: {str(exc)[:300]}") from None
        for name, w in zip(graph_outputs, want):
            if not np.allclose(data[name], w, rtol=1e-4, atol=1e-5):
                raise PackError(f"partition at {cut_tensors} changes output {name!r}; not kept")
        try:
            gpu_pending = partition_gpu(model_dir, manifest, cut_tensors, entries, feeds, generation) if gpu else []
        except OSError:
            raise
        except Exception as exc:   # the CPU stages stand on their own: GPU workers just do not run them
            log.warning("%s: the GPU skeleton cannot be cut at %s, its stages run on CPU workers only: %s",
                        model_dir, cut_tensors, str(exc)[:300])
            gpu_pending = []
        pending += gpu_pending
        for e, path in zip(entries, pending):
            placed.append(model_dir / e["file"])
            os.replace(path, placed[-1])
        for e, path in zip(entries, gpu_pending):
            placed.append(model_dir / e["gpu_file"])
            os.replace(path, placed[-1])
        kept = {e["file"] for e in entries} | {e["gpu_file"] for e in entries if e.get("gpu_file")}
        manifest.stages, manifest.stage_cuts = entries, cut_tensors
        manifest.batching = {}  # a calibration measured other stages
        if plan is not None:    # kept with the model, as its calibration is: what was planned, on which system
            write_atomic(model_dir / PLAN_FILE, json.dumps(plan, indent=1))
        if manifest.checksum:   # stage skeletons are stored files too: covered like the others (not in unverified versions)
            manifest.files = {f: r for f, r in manifest.files.items() if not f.startswith("stage-") and f != PLAN_FILE}
            manifest.files.update(integrity.record_files(model_dir, sorted(kept) + ([PLAN_FILE] if plan is not None else [])))
        write_manifest(model_dir, manifest)
        committed = True
    finally:
        if not committed:   # (each path tried on its own: one that fails to go must not keep the others)
            for path in pending + placed:
                remove_tree(path)
            if plan is not None:   # the old manifest's checksum of it holds again
                if old_plan is None:
                    remove_tree(model_dir / PLAN_FILE)
                else:
                    try:
                        write_atomic(model_dir / PLAN_FILE, old_plan)
                    except OSError as e:
                        log.error("%s: could not put back %s (%s); `modelcache verify` will say so", model_dir,
                                  PLAN_FILE, e)
    _remove_unused(model_dir, kept, keep_plan=plan is not None)
    return {"stages": entries, "cuts": cut_tensors, "files": manifest.files}


def _stage_file(stage: int, generation: int, gpu: bool = False) -> str:
    """A stage skeleton's file name: stage-K.onnx, or stage-K.G.onnx for a generation G > 0."""
    return f"stage-{stage}" + (f".{generation}" if generation else "") + (".gpu" if gpu else "") + ".onnx"


def _free_generation(manifest) -> int:
    """The first generation of stage file names that the model's current stages do not use: new stages are
    written beside the old ones, never over them, until the manifest names them."""
    used = {e.get(k) for e in manifest.stages for k in ("file", "gpu_file")}
    generation = 0
    while _stage_file(0, generation) in used or _stage_file(0, generation, gpu=True) in used:
        generation += 1
    return generation


def _read_if_there(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _remove_unused(model_dir: Path, kept: set, keep_plan: bool) -> None:
    """After the manifest changed: the stage files (and plan) it no longer names. What cannot be removed
    now is said and left: nothing reads it, and the next partition removes it."""
    unused = [p for p in model_dir.glob("stage-*.onnx") if p.name not in kept]
    if not keep_plan:
        unused.append(model_dir / PLAN_FILE)
    for path in unused:
        error = remove_tree(path)
        if error is not None:
            log.warning("%s: could not remove %s, which the model no longer uses: %s", model_dir, path.name, error)



def _gpu_cut_tensors(model_dir: Path, manifest) -> set[str]:
    """Tensors at which the model's GPU skeleton can be cut (the only one crossing a boundary)."""
    if not manifest.gpu_skeleton or not manifest.gpu_tensors:
        return set()
    model = onnx.load(str(model_dir / manifest.gpu_skeleton), load_external_data=False)
    return {c[0] for c in crossing_tensors(model) if len(c) == 1}


def partition_gpu(model_dir: Path, manifest, cut_tensors: list[str], entries: list[dict], feeds: dict,
                  generation: int = 0) -> list[Path]:
    """Cut the GPU skeleton at the CPU partition's tensors; write `stage-K.gpu.onnx.new` files and add
    "gpu_file" and "gpu_tensors" to each entry. Returns the files written ([] for a model without a GPU
    skeleton); raises when the GPU graph cannot be cut there or its stages do not give its outputs.

    Checked like the CPU stages, on the CPU: stage by stage, each stub overridden by an OrtValue over the
    weights blob (add_initializer, as GPU workers do over device memory), equals the whole GPU skeleton."""
    import onnxruntime as ort
    from ..session_options import attach_session_options, bind_weights

    if not manifest.gpu_skeleton or not manifest.gpu_tensors:
        return []
    skeleton = model_dir / manifest.gpu_skeleton
    model = onnx.load(str(skeleton), load_external_data=False)
    crossing = crossing_tensors(model)
    boundary = {}
    for i, c in enumerate(crossing):
        if len(c) == 1:
            boundary.setdefault(c[0], i + 1)
    missing = [t for t in cut_tensors if t not in boundary]
    if missing:
        raise PackError(f"no single-tensor cut at {missing} in the GPU graph")
    cuts = [boundary[t] for t in cut_tensors]
    if cuts != sorted(set(cuts)):
        raise PackError(f"the cut tensors {cut_tensors} come in another order in the GPU graph")
    bounds = [0, *cuts, len(model.graph.node)]
    dtypes = {t: _dtype_of(model, t) for t in cut_tensors}
    by_name = {t.name: t for t in manifest.gpu_tensors}
    rows = lambda names: [[n, by_name[n].dtype, by_name[n].shape, 0, by_name[n].offset, by_name[n].nbytes]  # noqa: E731
                          for n in names]
    written = []
    try:
        for s, (e, (a, b)) in enumerate(zip(entries, zip(bounds, bounds[1:]))):
            stage_model = build_stage(model, a, b, e["inputs"], e["outputs"], dtypes)
            e["gpu_file"] = _stage_file(s, generation, gpu=True)
            written.append(model_dir / f"{e['gpu_file']}.new")
            onnx.save_model(stage_model, str(written[-1]))
            e["gpu_tensors"] = sorted({t.name for t in stage_model.graph.initializer
                                       if t.data_location == onnx.TensorProto.EXTERNAL})
            unknown = [n for n in e["gpu_tensors"] if n not in by_name]
            if unknown:
                raise PackError(f"GPU stage {s} reads stubs {unknown[:3]} that the manifest does not know")
        blob = [str(model_dir / WEIGHTS_FILE)]
        so = attach_session_options()
        maps, values = bind_weights(so, blob, rows(by_name))
        want = ort.InferenceSession(str(skeleton), so, providers=["CPUExecutionProvider"]).run(None, feeds)
        data = dict(feeds)
        for e, path in zip(entries, written):
            so = attach_session_options()
            stage_maps, stage_values = bind_weights(so, blob, rows(e["gpu_tensors"]))
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            data.update(zip(e["outputs"], sess.run(e["outputs"], {k: data[k] for k in e["inputs"]})))
            del sess, stage_maps, stage_values
        outputs = [o.name for o in model.graph.output]
        for name, w in zip(outputs, want):
            if not np.allclose(data[name], w, rtol=1e-4, atol=1e-5):
                raise PackError(f"GPU stages change output {name!r}")
    except BaseException:
        for path in written:
            remove_tree(path)
        for e in entries:
            e.pop("gpu_file", None)
            e.pop("gpu_tensors", None)
        raise
    return written
