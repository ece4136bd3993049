"""A Triton config's `model_warmup`, read at import into the model's serving fields (daemon/warmup.py runs it).

Triton runs each warm-up sample when it loads a model, `count` times (at least once), as one execution of
`batch_size` requests; a sample of batch size 0 is skipped (backend_model_instance.cc, GenerateWarmupData and
WarmUp). Each input is zeros (`zero_data`), random bytes (`random_data`; zeros for strings, as Triton does), or a
file's bytes (`input_data_file`, in the model's `warmup/` folder: one request's worth of raw data, or of
length-prefixed strings). Checked here as Triton checks them, where it can be before a run: every dimension given,
the file there and long enough; and against the configuration: a named input that the model has, of its type and
dimensions.
"""

from __future__ import annotations

import base64
import math
from pathlib import Path

import numpy as np

from ..calibration import WARMUP_COUNT_MAX
from ..errors import InputError
from ..oip.types import decode_bytes_elements
from ..triton_protos import model_config_pb2 as mc
from ..triton_protos.datatypes import numpy_type_of

WARMUP_FOLDER = "warmup"             # Triton's kWarmupDataFolder
WARMUP_DATA_MAX = 16 << 20           # a model's warm-up files, in all: they are kept in its manifest


def samples(config: mc.ModelConfig, model_dir: Path) -> list[dict]:
    """The model's warm-up samples as its serving field "warmup" (calibration.check_serving): per sample its name,
    batch_size, count, and per input its "dtype" and "dims" with "fill": "zero" | "random", or a file's "data"
    (its bytes, base64) or "strings" (decoded). InputError says what Triton would refuse, or what does not match the configuration."""
    inputs = {i.name: i for i in config.input}
    out, data_bytes = [], 0
    for w in config.model_warmup:
        if w.batch_size == 0:   # (Triton skips it)
            continue
        where = f"model_warmup {w.name!r}"
        if config.max_batch_size and w.batch_size > config.max_batch_size:
            raise InputError(f"{where}: batch_size {w.batch_size} is more than max_batch_size {config.max_batch_size}")
        if w.count > WARMUP_COUNT_MAX:
            raise InputError(f"{where}: count {w.count}: modelcache runs a sample at most {WARMUP_COUNT_MAX} times")
        given = {}
        for name, spec in sorted(w.inputs.items()):
            given[name], used = _input(where, name, spec, inputs.get(name), model_dir)
            data_bytes += used
        missing = [n for n, i in inputs.items() if n not in given and not i.optional]
        if missing:
            raise InputError(f"{where}: no data for input {missing[0]!r}: give every input the model requires")
        out.append({"name": w.name, "batch_size": w.batch_size, "count": max(1, w.count), "inputs": given})
    if data_bytes > WARMUP_DATA_MAX:
        raise InputError(f"model_warmup: its input_data_file files hold {data_bytes / 2**20:.1f} MiB; modelcache keeps "
                         f"at most {WARMUP_DATA_MAX >> 20} MiB of them, in the model's manifest")
    return out


def _input(where: str, name: str, spec, configured, model_dir: Path) -> tuple[dict, int]:
    if configured is None:
        raise InputError(f"{where}: input {name!r} is not an input of the model's configuration")
    dtype = numpy_type_of(mc.DataType.Name(spec.data_type))
    if spec.data_type != configured.data_type:
        raise InputError(f"{where}: input {name!r} is {mc.DataType.Name(spec.data_type)}, the model's is "
                         f"{mc.DataType.Name(configured.data_type)}")
    dims = list(spec.dims)
    if any(d < 0 for d in dims):   # (Triton's words)
        raise InputError(f"{where}: warmup setting expects all variable-size dimensions are specified for input "
                         f"'{name}'")
    want = list(configured.dims)   # (as a client sends it; the model takes it reshaped, where it has a reshape)
    if len(dims) != len(want) or any(w != -1 and w != d for w, d in zip(want, dims)):
        raise InputError(f"{where}: input {name!r} has dims {dims}; the model's configuration says {want}")
    entry = {"dtype": dtype, "dims": dims}
    if configured.HasField("reshape"):
        entry["reshape"] = list(configured.reshape.shape)
    choice = spec.WhichOneof("input_data_type")
    if choice == "zero_data" or (choice == "random_data" and dtype == "object"):   # (Triton: zeros for strings)
        return {**entry, "fill": "zero"}, 0
    if choice == "random_data":
        return {**entry, "fill": "random"}, 0
    if choice != "input_data_file":   # (Triton's words)
        raise InputError(f"{where}: warmup setting expects input '{name}' to have input_data_type set")
    path = model_dir / WARMUP_FOLDER / spec.input_data_file
    if not path.resolve().is_relative_to((model_dir / WARMUP_FOLDER).resolve()):
        raise InputError(f"{where}: input {name!r}: input_data_file {spec.input_data_file!r} is outside the model's "
                         f"{WARMUP_FOLDER}/ folder")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{where}: input {name!r}: cannot read {path}: {e.strerror or e}") from None
    if dtype == "object":   # length-prefixed strings, as Triton reads them: there must be as many as the dims hold
        strings = decode_bytes_elements(memoryview(data), math.prod(dims), f"{where}: input {name!r}")
        return {**entry, "strings": list(strings)}, len(data)
    need = math.prod(dims) * np.dtype(dtype).itemsize
    if len(data) < need:   # (Triton's words, less its missing space)
        raise InputError(f"{where}: warmup setting expects {need} bytes, but the data provided from "
                         f"{spec.input_data_file} only has {len(data)} bytes")
    data = data[:need]
    return {**entry, "data": base64.b64encode(data).decode()}, len(data)
