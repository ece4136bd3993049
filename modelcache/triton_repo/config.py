"""One model directory of a Triton repository -> what to add: its versions, its completed configuration, its
batching policy, and the fields modelcache does not honour. Reads files; adds nothing.

config.pbtxt is parsed by protobuf's text_format against Triton's own model_config.proto (never by hand).
Where it is absent or leaves inputs, outputs or max_batch_size out, it is completed from the ONNX model as
Triton's onnxruntime backend does: every input and output, and max_batch_size 4 (Triton's
default-max-batch-size) with dynamic batching when every input and output has a free first dimension.
Then every input and output is checked against the model of every version imported: a mismatch refuses the
model, naming both sides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import FieldDescriptor

from ..calibration import PRIORITY_LEVELS_MAX
from ..errors import InputError, ModelCacheError
from ..oip.types import numpy_type_of, triton_type, v2_shape
from ..triton_protos import model_config_pb2 as mc
from . import ensemble, sequence, warmup
from .versions import present as present_versions, served as served_versions

CONFIG_FILE = "config.pbtxt"
ONNX_PLATFORM, ONNX_BACKEND, ONNX_FILE = "onnxruntime_onnx", "onnxruntime", "model.onnx"
DEFAULT_MAX_BATCH_SIZE = 4   # Triton's --backend-config=default-max-batch-size, for auto-completed models
# What other backends are, by platform or backend name and by their default model file name
OTHER_BACKENDS = {"tensorrt_plan": "a TensorRT plan", "tensorrt": "a TensorRT plan",
                  "pytorch_libtorch": "a TorchScript model", "pytorch": "a TorchScript model",
                  "python": "a Python backend model", "tensorflow_graphdef": "a TensorFlow GraphDef",
                  "tensorflow_savedmodel": "a TensorFlow SavedModel", "tensorflow": "a TensorFlow model",
                  "openvino": "an OpenVINO model", "ensemble": "an ensemble", "fil": "a FIL (tree) model",
                  "dali": "a DALI pipeline", "vllm": "a vLLM model", "tensorrtllm": "a TensorRT-LLM model"}
OTHER_FILES = {"model.plan": "tensorrt_plan", "model.pt": "pytorch_libtorch", "model.py": "python",
               "model.graphdef": "tensorflow_graphdef", "model.savedmodel": "tensorflow_savedmodel",
               "model.xml": "openvino"}
# Fields whose meaning modelcache carries out; a set field not here is listed in the model's one warning.
HONOURED = {"name", "platform", "backend", "version_policy", "max_batch_size", "default_model_filename",
            "input.name", "input.data_type", "input.dims", "input.format", "input.optional", "input.reshape",
            "output.name", "output.data_type", "output.dims", "output.reshape", "output.label_filename",
            "dynamic_batching.max_queue_delay_microseconds", "dynamic_batching.preferred_batch_size",
            # the queue policies and priority levels (executor/queues.py)
            "dynamic_batching.default_queue_policy.max_queue_size",
            "dynamic_batching.default_queue_policy.default_timeout_microseconds",
            "dynamic_batching.default_queue_policy.allow_timeout_override",
            "dynamic_batching.default_queue_policy.timeout_action", "dynamic_batching.priority_levels",
            "dynamic_batching.default_priority_level", "dynamic_batching.priority_queue_policy",
            "instance_group.name", "instance_group.kind",
            "response_cache.enable",   # the daemon's response cache (executor/response_cache.py)
            "model_warmup",            # run when the model is added or loaded (warmup.py), but a stateful model's
            "optimization.graph.level",   # the ORT optimization the model is packed with (ModelPlan.opt_level)
            # sequence_batching (sequence.py, executor/sequences.py)
            "sequence_batching.max_sequence_idle_microseconds", "sequence_batching.control_input.name",
            "sequence_batching.control_input.control.kind", "sequence_batching.control_input.control.int32_false_true",
            "sequence_batching.control_input.control.fp32_false_true",
            "sequence_batching.control_input.control.bool_false_true",
            "sequence_batching.control_input.control.data_type", "sequence_batching.state.input_name",
            "sequence_batching.state.output_name", "sequence_batching.state.data_type", "sequence_batching.state.dims",
            "sequence_batching.state.initial_state.data_type", "sequence_batching.state.initial_state.dims",
            "sequence_batching.state.initial_state.zero_data", "sequence_batching.state.initial_state.data_file",
            "sequence_batching.state.initial_state.name", "sequence_batching.direct.max_queue_delay_microseconds",
            "sequence_batching.oldest.max_candidate_sequences", "sequence_batching.oldest.preferred_batch_size",
            "sequence_batching.oldest.max_queue_delay_microseconds"}
CONTAINERS = {"input", "output", "dynamic_batching", "dynamic_batching.default_queue_policy", "instance_group",
              "optimization", "optimization.graph",
              "response_cache",
              "sequence_batching",
              "sequence_batching.control_input", "sequence_batching.control_input.control", "sequence_batching.state",
              "sequence_batching.state.initial_state", "sequence_batching.direct", "sequence_batching.oldest"}


class NotOnnx(Exception):
    """The model is another backend's: skipped, with this one line. `what` says what it is ("a TensorRT plan")."""

    def __init__(self, line: str, what: str = ""):
        super().__init__(line)
        self.what = what


@dataclass
class ModelPlan:
    name: str
    versions: list               # [(version, path of its .onnx file)], ascending
    config: dict                 # the completed configuration, as Triton's JSON: what ModelConfig answers
    serving: dict                # its batching policy (calibration.check_serving)
    not_honoured: list = field(default_factory=list)   # config fields set that modelcache does not carry out
    completed: list = field(default_factory=list)      # what auto-complete filled in
    labels: dict = field(default_factory=dict)         # output -> its label_filename's lines (classification)
    opt_level: str | None = None   # the ORT optimization its `optimization { graph { level } }` asks for; None: none

    @property
    def declared(self) -> dict:
        return {"serving": self.serving, "model_config": self.config, "labels": self.labels}

    def batching_text(self) -> str:
        s = self.serving
        text = "serial" if s.get("policy") != "dynamic" else \
            f"dynamic batching up to {s['max_batch']}, {s.get('max_queue_delay_ms', 0) * 1000:.0f} us delay" + \
            (f", preferred {', '.join(map(str, s['preferred_batch_sizes']))}" if s.get("preferred_batch_sizes") else "")
        if s.get("max_queue"):
            text += f", at most {s['max_queue']} queued"
        if s.get("queue_timeout_ms"):
            text += f", {s['queue_timeout_ms'] * 1000:.0f} us in the queue" + (" (then delayed)" if s.get("queue_delay")
                                                                                else "")
        if s.get("priority_levels"):
            text += f", {s['priority_levels']} priority levels (default {s['default_priority']})"
        if s.get("policy") != "dynamic" and s.get("max_batch"):
            text += f", at most {s['max_batch']} rows"
        text += ", response cache" if s.get("response_cache") else ""
        if s.get("warmup"):
            text += f", {len(s['warmup'])} warm-up sample" + ("s" if len(s["warmup"]) > 1 else "")
        return text + (f", {s['device'].upper()} only" if s.get("device") == "cpu" else "")


def read_config(model_dir: Path) -> mc.ModelConfig | None:
    """The model's config.pbtxt parsed against model_config.proto; None when there is none."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return text_format.Parse(path.read_text(), mc.ModelConfig())
    except text_format.ParseError as e:   # ("3:17 : Expected ...": where, then what)
        where = f":{e.GetLine()}:{e.GetColumn()}" if e.GetLine() else ""
        raise InputError(f"{path}{where}: {str(e).partition(' : ')[2] or e}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise InputError(f"{path}: cannot be read: {e}") from None


def parse_config_json(text) -> mc.ModelConfig:
    """A repository load's `config` parameter: the configuration as Triton's JSON, in place of config.pbtxt."""
    import json
    if not isinstance(text, str):
        raise InputError("Config parameter 'config' must have string type for its value")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InputError(f"Invalid config override: {e}") from None
    if not isinstance(doc, dict):   # (protobuf's parser takes a list, or a number, as an empty configuration)
        raise InputError(f"Invalid config override: a model configuration is a JSON object, not {type(doc).__name__}")
    try:
        return json_format.ParseDict(doc, mc.ModelConfig())
    except json_format.ParseError as e:   # (an unknown field, a value of the wrong type)
        raise InputError(f"Invalid config override: {e}") from None


def plan_model(model_dir: Path, model_io, override: mc.ModelConfig | None = None):
    """What importing `model_dir` adds: a ModelPlan, or an EnsemblePlan (ensemble.py) for an ensemble. NotOnnx
    for another backend's model; InputError (one line naming the model) for one that cannot be imported.
    `model_io(path) -> (inputs, outputs, overridable initializers)` reads an ONNX file's (packing.model_io).
    `override`: a configuration given in place of the directory's config.pbtxt (a repository load's `config`)."""
    name = model_dir.name
    try:
        given = read_config(model_dir) if override is None else override
        if ensemble.is_ensemble(given):
            return ensemble.plan_ensemble(model_dir, given, config_to_json(given))
        return _plan(model_dir, name, model_io, given)
    except ModelCacheError as e:
        raise InputError(f"{name}: {e}") from None


def _plan(model_dir: Path, name: str, model_io, given) -> ModelPlan:
    config = mc.ModelConfig() if given is None else _copy(given)
    if config.name and config.name != name:
        raise InputError(f"config.pbtxt names the model {config.name!r}, but its directory is {name!r}: "
                         "Triton requires them to match")
    config.name = name
    filename = config.default_model_filename or ONNX_FILE
    other = _other_backend(config, model_dir, filename)
    if other:
        raise NotOnnx(f"{name}: skipped: {other}; modelcache serves ONNX models only", other)
    config.platform, config.backend = ONNX_PLATFORM, ONNX_BACKEND
    versions = _versions(config, model_dir, filename)
    ios = {}
    for v, path in versions:
        try:
            ios[v] = model_io(str(path))
        except ModelCacheError as e:
            raise InputError(f"version {v}: {e}") from None
    hidden = sequence.hidden_names(config)   # (a stateful model's control and state tensors)
    completed = _complete(config, *ios[versions[-1][0]][:2], given, hidden)
    for v, path in versions:
        _check_against_model(config, *ios[v], f"{path.relative_to(model_dir.parent)}", hidden[0])
    serving = _serving(config)    # (from the groups given: those Triton fills in below do not limit the device)
    stateful = config.WhichOneof("scheduling_choice") == "sequence_batching"
    if config.model_warmup and not stateful:
        serving["warmup"] = warmup.samples(config, model_dir)
    not_honoured = [] if given is None else _unhonoured(given) + (["model_warmup"] if stateful and
                                                                   config.model_warmup else [])
    _normalize(config)
    if stateful:
        sequence.normalize(config)
        specs = {sequence.spec_of(config, *ios[v][:2], model_dir, f"{path.relative_to(model_dir.parent)}")
                 for v, path in versions}
        if len(specs) > 1:
            raise InputError("its versions' models differ in their sequence control or state tensors; import "
                             "them as separate models")
        serving["sequence"] = specs.pop().to_wire()
    return ModelPlan(name, versions, config_to_json(config), serving, not_honoured, completed,
                     _labels(config, model_dir), _opt_level(config))


def _normalize(config: mc.ModelConfig) -> None:
    """What Triton's core fills into every ONNX model's configuration (model_config_utils.cc, r24.10), so that
    ModelConfig answers as Triton would for the same directory: default_model_filename model.onnx; with no
    instance_group, one named as the model; each group's missing name (model_<i>), kind (KIND_CPU: what
    KIND_AUTO resolves to without a GPU) and count (2 for ONNX Runtime on the CPU, SetDefaultInstanceCount)."""
    if not config.default_model_filename:
        config.default_model_filename = ONNX_FILE
    if not config.instance_group:
        config.instance_group.add().name = config.name
    for i, group in enumerate(config.instance_group):
        group.name = group.name or f"{config.name}_{i}"
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            group.kind = mc.ModelInstanceGroup.KIND_CPU
        if group.count < 1:
            group.count = 2 if group.kind == mc.ModelInstanceGroup.KIND_CPU else 1


def _labels(config: mc.ModelConfig, model_dir: Path) -> dict:
    """Each output's label_filename (in the model's directory, one label a line): the classification extension
    names classes with them, as Triton does."""
    labels = {}
    for t in config.output:
        if t.label_filename:
            path = model_dir / t.label_filename
            try:
                labels[t.name] = path.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"output {t.name!r}: label_filename {t.label_filename}: cannot be read "
                                 f"({getattr(e, 'strerror', None) or e})") from None
    return labels


def _copy(msg: mc.ModelConfig) -> mc.ModelConfig:
    out = mc.ModelConfig()
    out.CopyFrom(msg)
    return out


def _other_backend(config: mc.ModelConfig, model_dir: Path, filename: str) -> str | None:
    """What other backend the model is for (a line's words), or None for ONNX Runtime's."""
    platform, backend = config.platform, config.backend
    if platform == ONNX_PLATFORM or backend == ONNX_BACKEND:
        if platform not in ("", ONNX_PLATFORM) or backend not in ("", ONNX_BACKEND):
            raise InputError(f"platform {platform!r} and backend {backend!r} disagree")
        return None
    if platform or backend:
        key = platform or backend
        return f"{OTHER_BACKENDS.get(key, 'a model for another backend')} ({'platform' if platform else 'backend'} " \
               f"{key})"
    files = {p.name for d in model_dir.iterdir() if d.is_dir() for p in d.iterdir()}
    if filename.endswith(".onnx") and filename in files:
        return None
    for file, key in OTHER_FILES.items():
        if file in files:
            return f"{OTHER_BACKENDS[key]} ({file}, no platform or backend set)"
    raise InputError(f"config.pbtxt sets no platform or backend, and no version directory holds {filename}")


def _versions(config: mc.ModelConfig, model_dir: Path, filename: str) -> list:
    """[(version, .onnx path)] that version_policy serves: latest N (default 1), all, or specific ones."""
    there = present_versions(model_dir)
    chosen = served_versions(config, there)
    missing = [v for v in chosen if v not in there]
    if missing:
        raise InputError(f"version_policy specific names version {missing[0]}, which has no directory")
    if not chosen:
        raise InputError("no version directory (1/, 2/, ...) to import")
    out = []
    for v in chosen:
        path = model_dir / str(v) / filename
        if path.is_dir():   # Triton's form for a model with external data: a directory holding model.onnx
            path = path / ONNX_FILE
        if not path.is_file():
            raise InputError(f"version {v} has no {filename}")
        out.append((v, path))
    return out


def _free_first(entries) -> bool:
    return all(e.shape and not isinstance(e.shape[0], int) for e in entries)


def _complete(config: mc.ModelConfig, inputs, outputs, given, hidden=(set(), set())) -> list[str]:
    """Fill what the configuration leaves out from the model, as Triton's onnxruntime backend does; returns
    what was filled in, for the import's line. `hidden`: (inputs, outputs) a stateful model's server fills and
    keeps (sequence.hidden_names), never configured as the client's."""
    filled = []
    if not config.input and not config.output and config.max_batch_size == 0 and _free_first(inputs) \
            and _free_first(outputs):
        config.max_batch_size = DEFAULT_MAX_BATCH_SIZE
        filled.append(f"max_batch_size {DEFAULT_MAX_BATCH_SIZE}")
    batch = config.max_batch_size > 0
    for entries, repeated, what, skip in ((inputs, config.input, "inputs", hidden[0]),
                                          (outputs, config.output, "outputs", hidden[1])):
        if not repeated:
            for e in (e for e in entries if e.name not in skip):
                t = repeated.add()
                t.name, t.data_type = e.name, mc.DataType.Value(triton_type(e.dtype))
                t.dims.extend(v2_shape(e.shape[1:] if batch else e.shape))
            filled.append(what)
    if config.max_batch_size > 1 and config.WhichOneof("scheduling_choice") is None:
        config.dynamic_batching.SetInParent()   # Triton: a batching model with no scheduler gets the dynamic batcher
        filled.append("dynamic_batching")
    if given is None:
        filled.insert(0, "no config.pbtxt")
    return filled


def _check_against_model(config: mc.ModelConfig, inputs, outputs, overridable, where: str,
                         hidden: set = frozenset()) -> None:
    """Each configured input and output against the model's: names, types, dims. Inputs: the model's, and any
    of its overridable initializers (what Triton's ORT backend merges into the inputs: an initializer that is
    also a graph input, served as an input a request may leave out when the config says `optional: true`),
    less the `hidden` ones a stateful model's server fills (its controls and states: sequence.py checks them);
    outputs: any of the model's (Triton allows fewer)."""
    batch = config.max_batch_size
    configured = [t.name for t in config.input]
    model_in = {e.name: e for e in inputs if e.name not in hidden} | \
        {e.name: e for e in overridable if e.name in configured}
    model_out = {e.name: e for e in outputs}
    for t in config.input:
        if t.optional and batch:   # (Triton's backend refuses the load in these words)
            raise InputError(f"optional input {t.name!r} is not supported for models that support batching "
                             f"(max_batch_size {batch}); set max_batch_size: 0")
    if sorted(configured) != sorted(model_in):
        extra = sorted(set(configured) - set(model_in))
        lacking = sorted(set(model_in) - set(configured))
        raise InputError(f"config.pbtxt inputs {configured} do not match {where}'s inputs {sorted(model_in)}"
                         + (f": no input {extra[0]!r} in the model" if extra else
                            f": the model's input {lacking[0]!r} is not configured" if lacking else ""))
    for kind, tensors, model in (("input", config.input, model_in), ("output", config.output, model_out)):
        for t in tensors:
            e = model.get(t.name)
            if e is None:
                raise InputError(f"config.pbtxt {kind} {t.name!r}: {where} has no such {kind} "
                                 f"(its {kind}s: {sorted(model)})")
            _check_tensor(kind, t, e, batch, where)


def _check_tensor(kind: str, t, e, batch: int, where: str) -> None:
    wanted = mc.DataType.Name(t.data_type)
    # reshape: the model takes (or makes) reshape.shape, clients send (or get) dims (the fronts reshape between
    # the two, oip/reshape.py): the model is checked against the former, and the two must hold as many elements
    dims = ([-1] if batch else []) + list(t.reshape.shape if t.HasField("reshape") else t.dims)
    if t.HasField("reshape"):
        given, want = list(t.dims), list(t.reshape.shape)
        if all(d >= 0 for d in given + want) and math.prod(given) != math.prod(want):
            raise InputError(f"config.pbtxt {kind} {t.name!r}: dims {given} hold {math.prod(given)} elements, its "
                             f"reshape {want} {math.prod(want)}: a reshape keeps the number of elements")
    shape = v2_shape(e.shape or [])
    mine = f"config.pbtxt {kind} {t.name!r} is {wanted} {dims}" + (f" (max_batch_size {batch})" if batch else "")
    theirs = f"{where} has {e.dtype} {shape}"
    if numpy_type_of(wanted) != e.dtype:
        raise InputError(f"{mine}; {theirs}: the types differ")
    if batch and (not e.shape or isinstance(e.shape[0], int)):
        raise InputError(f"{mine}; {theirs}: its first dimension is fixed, so it cannot batch; set max_batch_size: 0 "
                         "and give its whole shape in dims")
    if len(dims) != len(shape) or any(c >= 0 and m >= 0 and c != m for c, m in zip(dims, shape)):
        raise InputError(f"{mine}; {theirs}: the dims differ")
    if any(c < -1 for c in dims):
        raise InputError(f"{mine}: a dim must be -1 (free) or a size >= 0")


def _serving(config: mc.ModelConfig) -> dict:
    """The model's batching policy in modelcache's terms (calibration.check_serving)."""
    batch = config.max_batch_size
    if batch < 0:
        raise InputError(f"max_batch_size {batch}: must be 0 (no batching) or more")
    serving = {"policy": "serial", "max_batch": batch}
    if config.WhichOneof("scheduling_choice") == "dynamic_batching":
        db = config.dynamic_batching
        if batch < 1:
            raise InputError("dynamic_batching needs max_batch_size >= 1")
        too_big = [b for b in db.preferred_batch_size if not 1 <= b <= batch]
        if too_big:
            raise InputError(f"dynamic_batching preferred_batch_size {too_big[0]} is not within 1..max_batch_size "
                             f"{batch}")
        serving.update(policy="dynamic", max_queue_delay_ms=db.max_queue_delay_microseconds / 1000,
                       preferred_batch_sizes=sorted(set(db.preferred_batch_size)))
        serving.update(_queue_policy(db.default_queue_policy))
        if db.priority_levels:   # (checked as Triton checks them: model_config_utils.cc, in its words)
            levels = db.priority_levels
            if levels > PRIORITY_LEVELS_MAX:
                raise InputError(f"dynamic_batching priority_levels {levels}: modelcache serves at most "
                                 f"{PRIORITY_LEVELS_MAX}")
            if not 1 <= db.default_priority_level <= levels:
                raise InputError(f"default priority level must be in range [1, {levels}] for {config.name}")
            wrong = sorted(k for k in db.priority_queue_policy if not 1 <= k <= levels)
            if wrong:
                raise InputError(f"priority queue policy must have priority level in range [1, {levels}] for "
                                 f"{config.name}")
            serving.update(priority_levels=levels, default_priority=db.default_priority_level)
            if db.priority_queue_policy:
                serving["priority_queues"] = {str(k): _queue_policy(v) for k, v in
                                              sorted(db.priority_queue_policy.items())}
    if config.WhichOneof("scheduling_choice") == "sequence_batching":
        serving.update(sequence.serving(config))
    if config.response_cache.enable:   # refused where Triton refuses it (model_config_utils.cc), in its words
        stateful = config.WhichOneof("scheduling_choice") == "sequence_batching"
        refused = "sequence batching scheduler" if stateful else \
            "'decoupled' transaction policy" if config.model_transaction_policy.decoupled else None
        if refused:
            raise InputError(f"Response Cache does not currently support model {config.name} with {refused}. "
                             "Please disable the response cache.")
        serving["response_cache"] = True
    if "intra_op_thread_count" in config.parameters:   # (the onnxruntime backend's; 0: its default, every core)
        text = config.parameters["intra_op_thread_count"].string_value
        if not text.strip().isdigit() or not 0 <= int(text) <= 1024:
            raise InputError(f"parameters intra_op_thread_count {text!r}: give a whole number of threads, 0 for "
                             "the default")
        if int(text):
            serving["intra_op_threads"] = int(text)
    kinds = {g.kind for g in config.instance_group}
    if kinds == {mc.ModelInstanceGroup.KIND_CPU}:
        serving["device"] = "cpu"   # never on a GPU worker; KIND_GPU serves where the daemon has GPU workers
    return serving


# Triton's onnxruntime backend (onnxruntime.cc): graph level -1 basic, 1 extended, 2 none, anything else all
GRAPH_LEVELS = {-1: "basic", 1: "extended", 2: "disable"}


def _opt_level(config: mc.ModelConfig) -> str | None:
    """The ORT optimization level the model's configuration asks for, as Triton's ORT backend reads it; None where
    it says nothing (the daemon's `opt_level` setting applies)."""
    if not config.optimization.HasField("graph"):
        return None
    return GRAPH_LEVELS.get(config.optimization.graph.level, "all")


def _queue_policy(queue: mc.ModelQueuePolicy) -> dict:
    """A Triton ModelQueuePolicy in modelcache's terms (executor/queues.QueuePolicy). allow_timeout_override is
    honoured as it stands: a request's own timeout is its deadline for its whole run, whatever the policy says."""
    policy: dict = {}
    if queue.max_queue_size:
        policy["max_queue"] = min(queue.max_queue_size, 1 << 31)
    if queue.default_timeout_microseconds:
        policy["queue_timeout_ms"] = min(queue.default_timeout_microseconds / 1000, 3.6e6)
        if queue.timeout_action == mc.ModelQueuePolicy.DELAY:
            policy["queue_delay"] = True
    return policy


# The onnxruntime backend's `parameters` modelcache carries out (the rest are listed by key: parameters.KEY)
HONOURED_PARAMETERS = {"intra_op_thread_count"}


def _unhonoured(msg, prefix: str = "") -> list[str]:
    """The set fields of a configuration that modelcache does not carry out, as dotted paths, once each."""
    out: list[str] = []
    for f, value in msg.ListFields():
        path = prefix + f.name
        if path in HONOURED or (path == "instance_group.count" and value == 1):
            continue
        if path == "parameters":
            out += [f"parameters.{k}" for k in sorted(value) if k not in HONOURED_PARAMETERS]
            continue
        if path in CONTAINERS:
            for item in (value if f.is_repeated else [value]):
                out += [p for p in _unhonoured(item, path + ".") if p not in out]
        elif path not in out:
            out.append(path)
    return out


def config_to_json(config: mc.ModelConfig) -> dict:
    """The configuration as Triton's JSON: field names as in the .proto, every field with its value even when
    it is the default (max_batch_size 0 is said, as Triton says it), enums by name, 64-bit integers as numbers
    (protobuf's JSON mapping writes them as strings; Triton's HTTP front and tritonclient use numbers)."""
    d = json_format.MessageToDict(config, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    _int64s_as_numbers(config, d)
    return d


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _int64s_as_numbers(msg, d: dict) -> None:
    for f in msg.DESCRIPTOR.fields:
        if f.name not in d:
            continue
        value = getattr(msg, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            inner = f.message_type.fields_by_name["value"]
            # (JSON's keys are strings; a map keyed by integers, as priority_queue_policy is, is read by its own)
            numeric = f.message_type.fields_by_name["key"].cpp_type != FieldDescriptor.CPPTYPE_STRING
            for k in d[f.name]:
                if inner.message_type is not None:
                    _int64s_as_numbers(value[int(k) if numeric else k], d[f.name][k])
                elif inner.type in _INT64:
                    d[f.name][k] = int(d[f.name][k])
        elif f.message_type is not None:
            for m, sub in zip(value, d[f.name]) if f.is_repeated else [(value, d[f.name])]:
                _int64s_as_numbers(m, sub)
        elif f.type in _INT64:
            d[f.name] = [int(x) for x in d[f.name]] if f.is_repeated else int(d[f.name])
