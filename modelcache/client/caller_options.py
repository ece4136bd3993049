"""A private copy of the SessionOptions a caller hands to the drop-in session.

Why a copy: the session binds each shared weight to its options (`add_initializer`) and turns the
optimizers off. Done on the caller's object, a second session over the same options failed ("An
OrtValue for this name has already been added"), and a plain onnxruntime session built from them
later would run unoptimized over weights that this session unmaps at close. ONNX Runtime gives no way
to copy a SessionOptions nor to list its config entries, so the copy takes every property and the
config entries named below; what ORT cannot read back (free-dimension overrides, custom-op libraries,
providers or initializers added to it) is not carried over, and providers added to it are refused.
"""

from __future__ import annotations

# Session config entries (onnxruntime_session_options_config_keys.h) that a caller sets to tune a run;
# the ones about optimizing or saving a graph have no effect over a packed, already optimized skeleton.
CONFIG_KEYS = (
    "session.intra_op.allow_spinning", "session.inter_op.allow_spinning", "session.force_spinning_stop",
    "session.intra_op.spin_duration_us", "session.inter_op.spin_duration_us", "session.intra_op_thread_affinities",
    "session.dynamic_block_base", "session.set_denormal_as_zero", "session.use_env_allocators",
    "session.use_device_allocator_for_initializers", "session.disable_cpu_ep_fallback",
    "session.record_ep_graph_assignment_info", "session.use_deterministic_compute", "session.kernel_dispatch_policy",
    "mlas.enable_gemm_fastmath_arm64_bfloat16", "session.qdqisint8allowed", "session.x64quantprecision",
)


def copy_of(caller):
    """A new onnxruntime.SessionOptions with `caller`'s properties and CONFIG_KEYS entries; None gives defaults."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if caller is None:
        return so
    if not isinstance(caller, ort.SessionOptions):
        hint = f" (a model version goes by keyword: version={caller!r})" if isinstance(caller, (int, str)) else ""
        raise TypeError(f"sess_options must be an onnxruntime.SessionOptions, not {type(caller).__name__}{hint}")
    if caller.has_providers():
        raise ValueError("sess_options has execution providers added to it (add_provider...): modelcache chooses "
                         "them from providers=, where the model's weights are leased; pass providers= instead")
    for name, attr in vars(ort.SessionOptions).items():
        if isinstance(attr, property) and attr.fset is not None:
            setattr(so, name, getattr(caller, name))
    for key in CONFIG_KEYS:
        try:
            value = caller.get_session_config_entry(key)
        except RuntimeError:   # not set: ORT's only way to say so
            continue
        so.add_session_config_entry(key, value)
    return so
