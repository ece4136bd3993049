"""A config.pbtxt's `sequence_batching` -> the SequenceSpec the daemon serves it with (executor/sequences.py),
checked against the model: each control input and state is one of the model's inputs (outputs), of the type
and dims the configuration says, as Triton's core and onnxruntime backend check them when they load it."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..executor.sequences import DEFAULT_IDLE_US, Control, SequenceSpec, State
from ..oip.types import numpy_type_of, v2_shape
from ..triton_protos import model_config_pb2 as mc

SB = mc.ModelSequenceBatching
KINDS = {SB.Control.CONTROL_SEQUENCE_START: "start", SB.Control.CONTROL_SEQUENCE_END: "end",
         SB.Control.CONTROL_SEQUENCE_READY: "ready", SB.Control.CONTROL_SEQUENCE_CORRID: "corrid"}
CORRID_TYPES = {mc.TYPE_UINT64: "uint64", mc.TYPE_INT64: "int64", mc.TYPE_UINT32: "uint32", mc.TYPE_INT32: "int32",
                mc.TYPE_STRING: "object"}
INITIAL_STATE_DIR = "initial_state"   # where Triton reads an initial_state's data_file, in the model's directory


def hidden_names(config: mc.ModelConfig) -> tuple[set, set]:
    """(inputs, outputs) the server feeds and keeps: control and state inputs, state outputs. Clients neither send
    nor see them, and auto-complete leaves them out of the configuration."""
    if config.WhichOneof("scheduling_choice") != "sequence_batching":
        return set(), set()
    sb = config.sequence_batching
    return {c.name for c in sb.control_input} | {s.input_name for s in sb.state}, {s.output_name for s in sb.state}


def normalize(config: mc.ModelConfig) -> None:
    """What Triton's core fills in (model_config_utils.cc): the idle timeout, oldest's preferred batch size."""
    if config.WhichOneof("scheduling_choice") != "sequence_batching":
        return
    sb = config.sequence_batching
    if sb.max_sequence_idle_microseconds == 0:
        sb.max_sequence_idle_microseconds = DEFAULT_IDLE_US
    if sb.HasField("oldest") and not sb.oldest.preferred_batch_size and config.max_batch_size > 0:
        sb.oldest.preferred_batch_size.append(config.max_batch_size)


def serving(config: mc.ModelConfig) -> dict:
    """The batching policy of a stateful model: one request per sequence in a batch, the strategy's delay."""
    sb, batch = config.sequence_batching, config.max_batch_size
    strategy = sb.oldest if sb.HasField("oldest") else sb.direct
    out = {"policy": "dynamic" if batch > 1 else "serial", "max_batch": batch}
    if batch > 1:
        out["max_queue_delay_ms"] = strategy.max_queue_delay_microseconds / 1000
        if sb.HasField("oldest"):
            too_big = [b for b in sb.oldest.preferred_batch_size if not 1 <= b <= batch]
            if too_big:
                raise InputError(f"sequence_batching oldest preferred_batch_size {too_big[0]} is not within "
                                 f"1..max_batch_size {batch}")
            out["preferred_batch_sizes"] = sorted(set(sb.oldest.preferred_batch_size))
    return out


def spec_of(config: mc.ModelConfig, inputs, outputs, model_dir: Path, where: str) -> SequenceSpec:
    """The SequenceSpec of a normalized configuration, checked against one version's model (IOEntry lists)."""
    sb, batch = config.sequence_batching, config.max_batch_size
    model_in, model_out = {e.name: e for e in inputs}, {e.name: e for e in outputs}
    controls = []
    for ci in sb.control_input:
        if len(ci.control) != 1:
            raise InputError(f"sequence_batching control_input {ci.name!r} must have exactly one control, "
                             f"has {len(ci.control)}")
        controls.append(_control(ci.name, ci.control[0], model_in, where))
    if len({c.kind for c in controls}) != len(controls):
        raise InputError("sequence_batching names a control kind (START, END, READY, CORRID) twice")
    states = [_state(s, model_in, model_out, batch, {t.name for t in config.output}, model_dir, where)
              for s in sb.state]
    slots = max(1, batch)
    if sb.HasField("oldest") and sb.oldest.max_candidate_sequences > 0:
        slots = sb.oldest.max_candidate_sequences
    slots *= max(1, sum(g.count for g in config.instance_group))   # (slots per instance, as Triton's batchers)
    return SequenceSpec(tuple(controls), tuple(states), "oldest" if sb.HasField("oldest") else "direct",
                        int(sb.max_sequence_idle_microseconds), slots)


def _control(name: str, c, model_in: dict, where: str) -> Control:
    kind = KINDS[c.kind]
    e = model_in.get(name)
    if e is None:
        raise InputError(f"sequence_batching control input {name!r}: {where} has no such input (its inputs: "
                         f"{sorted(model_in)})")
    if kind == "corrid":
        dtype = CORRID_TYPES.get(c.data_type)
        if dtype is None:
            raise InputError(f"sequence_batching CORRID control {name!r}: data_type must be TYPE_UINT64, TYPE_INT64, "
                             f"TYPE_UINT32, TYPE_INT32 or TYPE_STRING, not {mc.DataType.Name(c.data_type)}")
        false, true = 0, 0
    else:
        given = [(f, list(getattr(c, f))) for f in ("int32_false_true", "fp32_false_true", "bool_false_true")
                 if getattr(c, f)]
        if len(given) != 1 or len(given[0][1]) != 2:
            raise InputError(f"sequence_batching control {name!r} ({kind.upper()}): give exactly one of "
                             "int32_false_true, fp32_false_true, bool_false_true, with two values (false, true)")
        field, (false, true) = given[0]
        dtype = {"int32_false_true": "int32", "fp32_false_true": "float32", "bool_false_true": "bool"}[field]
    if e.dtype != dtype:
        raise InputError(f"sequence_batching control {name!r} is {dtype}; {where} has {e.dtype} for it: the types "
                         "differ")
    return Control(name, kind, dtype, false, true, len(e.shape or []))


def _state(s, model_in: dict, model_out: dict, batch: int, configured_outputs: set, model_dir: Path,
           where: str) -> State:
    if s.input_name not in model_in:
        raise InputError(f"sequence_batching state input {s.input_name!r}: {where} has no such input")
    if s.output_name not in model_out:
        raise InputError(f"sequence_batching state output {s.output_name!r}: {where} has no such output")
    dtype = numpy_type_of(mc.DataType.Name(s.data_type))
    dims = list(s.dims)
    full = ([-1] if batch else []) + dims
    for kind, e in (("input", model_in[s.input_name]), ("output", model_out[s.output_name])):
        shape = v2_shape(e.shape or [])
        if e.dtype != dtype:
            raise InputError(f"sequence_batching state {kind} {e.name!r} is {mc.DataType.Name(s.data_type)}; "
                             f"{where} has {e.dtype}: the types differ")
        if len(shape) != len(full) or any(c >= 0 and m >= 0 and c != m for c, m in zip(full, shape)):
            raise InputError(f"sequence_batching state {kind} {e.name!r} has dims {full}; {where} has {shape}: the "
                             "dims differ")
    if len(s.initial_state) > 1:   # (Triton's words)
        raise InputError(f"initial_state field for state input '{s.input_name}' must contain exactly one or zero "
                         f"element. Found '{len(s.initial_state)}' elements.")
    initial, shape = None, [1 if d < 0 else d for d in dims]   # (Triton: a free dim is 1 in the first state)
    if s.initial_state:
        init = s.initial_state[0]
        if init.data_type != s.data_type:
            raise InputError(f"the initial_state of state {s.input_name!r} is {mc.DataType.Name(init.data_type)}, "
                             f"the state {mc.DataType.Name(s.data_type)}: they must match")
        if len(init.dims) != len(dims) or any(d >= 0 and i != d for i, d in zip(init.dims, dims)) \
                or any(i < 0 for i in init.dims):
            raise InputError(f"the initial_state of state {s.input_name!r} has dims {list(init.dims)}; the state "
                             f"{dims}: give every dim, equal to the state's where it is fixed")
        shape = list(init.dims)
        if init.WhichOneof("state_data") == "data_file":
            initial = _initial_data(model_dir / INITIAL_STATE_DIR / init.data_file, dtype, shape, s.input_name)
    if batch:
        shape = [1] + shape
    return State(s.input_name, s.output_name, dtype, tuple(shape), initial, s.output_name in configured_outputs)


def _initial_data(path: Path, dtype: str, shape: list, name: str) -> bytes:
    import math

    import numpy as np
    if dtype == "object":
        raise InputError(f"the initial_state of state {name!r}: a TYPE_STRING state from a data_file is not "
                         "supported; use zero_data")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"the initial_state of state {name!r}: {path} cannot be read ({e.strerror or e})") from None
    need = math.prod(shape) * np.dtype(dtype).itemsize
    if len(data) < need:
        raise InputError(f"the initial_state of state {name!r}: {path} holds {len(data)} bytes; the state needs "
                         f"{need}")
    return data[:need]
