"""What the drop-in sessions share, attach (session.py) and serve (serve.py): onnxruntime.InferenceSession's
arguments read the way modelcache takes them, and the methods of ORT's that a session does not support."""

from __future__ import annotations

import contextlib
import os

from ..errors import ModelNotFound

# onnxruntime.InferenceSession's public methods (ORT 1.32), listed because serve mode never imports onnxruntime.
ORT_SESSION_METHODS = frozenset({
    "run", "run_async", "run_with_ort_values", "run_with_iobinding", "run_with_ortvaluevector", "io_binding",
    "get_inputs", "get_outputs", "get_overridable_initializers", "get_modelmeta", "get_providers",
    "get_provider_options", "get_session_options", "get_input_memory_infos", "get_output_memory_infos",
    "get_input_epdevices", "get_provider_graph_assignment_info", "get_profiling_start_time_ns", "end_profiling",
    "create_ortvalue_from_shape_and_type", "release_captured_graph", "get_tuning_results", "set_tuning_results",
    "set_ep_dynamic_options", "set_providers", "enable_fallback", "disable_fallback"})
# ORT's keyword arguments past provider_options: nothing to do here (the graph was optimized at add time,
# the skeleton holds no config, and modelcache never falls back to other providers), so accepted and unused.
ORT_KWARGS = frozenset({"enable_fallback", "read_config_from_model", "disabled_optimizers"})


def refusal(method: str, why: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(f"modelcache.InferenceSession.{method}() is not supported: {why}")
    refused.__name__ = method
    return refused


def without_ort_kwargs(kwargs: dict, ours: set) -> dict:
    """`kwargs` less ORT's own (ORT_KWARGS); TypeError for any that is neither ORT's nor in `ours`."""
    unknown = sorted(k for k in kwargs if k not in ORT_KWARGS and k not in ours)
    if unknown:
        raise TypeError(f"InferenceSession() got an unexpected keyword argument {unknown[0]!r}")
    return {k: v for k, v in kwargs.items() if k not in ORT_KWARGS}


def refuse_in_serve_mode(**given) -> None:
    """Serve mode runs the model in the daemon, on the daemon's session options and devices."""
    named = [k for k, v in given.items() if v is not None]
    if named:
        raise ValueError(f"mode='serve' takes no {named[0]}: the daemon runs the model with its own session options "
                         f"and devices; leave {named[0]} out, or open the model with mode='attach'")


def model_name(path_or_name) -> str:
    """The model name a caller gave in ORT's path_or_bytes place; TypeError for what only ORT opens."""
    if isinstance(path_or_name, (bytes, bytearray, memoryview)):
        raise TypeError("modelcache opens models by name, not from serialized bytes: save the model and add it "
                        "first with `modelcache add PATH --name NAME`, then open NAME")
    name = os.fspath(path_or_name)
    if not isinstance(name, str):
        raise TypeError(f"a model name must be a str, not {type(name).__name__}")
    return name


def model_version(version) -> int | None:
    """A version as the daemon takes it: None (the newest) or an int >= 1; "3" is taken as 3."""
    if isinstance(version, str) and version.strip().isdigit():
        version = int(version)
    if version is None or (isinstance(version, int) and not isinstance(version, bool) and version >= 1):
        return version
    raise TypeError(f"version must be an int >= 1 (or None for the newest), not {version!r}")


@contextlib.contextmanager
def hint_if_a_file(path_or_name):
    """A model not found under a name that is a file path says how to add it."""
    try:
        yield
    except ModelNotFound as e:
        name = os.fspath(path_or_name)
        if os.sep in name or name.endswith((".onnx", ".ort")) or os.path.isfile(name):
            raise ModelNotFound(f"{e}; modelcache opens models by name: add it first with "
                                f"`modelcache add {name} --name NAME`, then open NAME") from None
        raise
