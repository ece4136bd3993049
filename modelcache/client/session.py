"""The drop-in `InferenceSession`: an ONNX Runtime session over the daemon's shared weights.

Each weight becomes an OrtValue over memory the daemon lends and is handed to ORT with
`add_initializer`, over a skeleton that ORT optimized at add time. Nothing is read, parsed
or copied (benchmarks/binding has the measurement). Where the weights are follows the
providers, as with onnxruntime: CPUExecutionProvider (the default) maps the host tier's
shared-memory segments read-only; CUDAExecutionProvider maps the model's copy on that GPU
through CUDA IPC handles (client/device.py) under the model's GPU skeleton. The mappings
live as long as this object; the daemon's lease is released on close.
"""

from __future__ import annotations


import os
import warnings

from typing import TYPE_CHECKING

from ..errors import InputError, ModelCacheError
from ..session_options import attach_session_options, bind_weights, portable_session_options, read_whole
from ..wire.tensors import NUMPY_TYPES, FeedCheck
from .caller_options import copy_of
from .dropin import (ORT_SESSION_METHODS, hint_if_a_file, model_name, model_version, refusal,
                     refuse_in_serve_mode, without_ort_kwargs)

# ORT's methods that re-create the session: over weights leased for one device, refused.
_REBUILDS = ("it re-creates the session on other execution providers, and the weights are leased for the device "
             "this one was opened on: open a new modelcache.InferenceSession with those providers")
_REFUSED_IN_ATTACH_MODE = {"set_providers": _REBUILDS, "enable_fallback": _REBUILDS}

if TYPE_CHECKING:   # connection.py imports pyzmq: a drop-in session on the lane never needs it (client/leases.py)
    from .connection import Client, OpenedModel


class InferenceSession:
    """`onnxruntime.InferenceSession`'s signature, `run`, `get_inputs`, `get_outputs` and the rest of its
    surface (docs/sessions.md, "Differences from onnxruntime.InferenceSession"), over a model opened by name.

    mode="attach" (default): ORT runs in this process over the daemon's shared weights.
    mode="serve": the daemon runs the model; this process never imports onnxruntime.
    version: the model's version (default: the newest). prepacked: share the model's pre-packed MatMul
    weights where it has them (default: MODELCACHE_PREPACKED, on): warm runs as fast as plain ORT's, at
    the cost of ORT packing each weight once at session start.
    """

    def __new__(cls, path_or_name, sess_options=None, providers=None, provider_options=None, *,
                version: int | None = None, client: Client | None = None, socket: str | None = None,
                mode: str = "attach", **kwargs):
        if mode == "serve":
            from .serve import ServeSession
            refuse_in_serve_mode(sess_options=sess_options, providers=providers, provider_options=provider_options)
            kwargs.pop("prepacked", None)   # the daemon's sessions: not the caller's choice
            return ServeSession(path_or_name, version=version, client=client, socket=socket,
                                **without_ort_kwargs(kwargs, {"deadline_ms", "priority"}))
        if mode != "attach":
            raise ValueError(f"mode must be 'attach' or 'serve', not {mode!r}")
        return super().__new__(cls)

    def __init__(self, path_or_name, sess_options=None, providers=None, provider_options=None, *,
                 version: int | None = None, client: Client | None = None, socket: str | None = None,
                 mode: str = "attach", prepacked: bool | None = None, **kwargs):
        import onnxruntime as ort

        without_ort_kwargs(kwargs, set())
        name, version = model_name(path_or_name), model_version(version)
        providers = _with_provider_options(providers, provider_options)
        so = copy_of(sess_options)   # (the caller's stays untouched: client/caller_options.py)
        self._client = client
        self._lease: OpenedModel | None = None
        self._released = False
        self._sess = None
        self._maps: list = []
        self._weights: list = []
        self._device_weights = None
        self.prepacked = False          # whether this session shares the model's pre-packed MatMul weights
        self._trim_after_run = False
        device = _device_for(providers, ort)
        with hint_if_a_file(path_or_name):
            self._lease = self._open(name, version, device or "cpu", socket)
        host_fds = _take_host_fds(self._lease)
        try:
            # Shared pre-packed MatMul weights: faster warm runs, a slower session start (prepack.py).
            self.prepacked = bool(self._lease.prepacked) and not self._lease.device_uuid and _want_prepacked(prepacked)
            if host_fds and self.prepacked and not os.path.exists(self._lease.skeleton_path):
                self.prepacked = False   # ORT maps the blobs by path, and this process cannot see the tier's
            so = attach_session_options(so, prepacked=self.prepacked)
            # ORT keeps raw pointers into these mappings: they must outlive the session.
            if self._lease.device_uuid:
                from .device import attach_weights, cuda_first, is_cuda_kind
                fds, self._lease.received_fds = getattr(self._lease, "received_fds", []), []   # attach closes them
                self._device_weights = attach_weights(so, self._lease.ipc_kind, self._lease.device_uuid,
                                                      self._lease.ipc_handles, self._lease.tensors, fds)
                model = self._lease.skeleton_path
                if not is_cuda_kind(self._lease.ipc_kind):   # a simulated GPU: its memory is host memory
                    providers = ["CPUExecutionProvider"]
                else:
                    providers = cuda_first(providers)
            else:
                model, self._maps, self._weights = _host_weights(so, self._lease, host_fds, self.prepacked)
                host_fds = []   # (closed)
            self._sess = ort.InferenceSession(model, so, providers=providers or ["CPUExecutionProvider"])
            # ORT's one-off packings (computed to find each shared blob's key, then freed) stay resident as freed
            # heap: given back after the session is built and after its first run; later runs stay trimmed.
            self._trim_after_run = self.prepacked
            if self.prepacked:
                from ..memlimit import release_freed_heap   # (not at the top: a cold start without prepacks skips it)
                release_freed_heap()
            on_gpu = self._lease.ipc_kind in ("cuda", "cuda-vmm")
            if on_gpu and self._sess.get_providers()[0] != "CUDAExecutionProvider":
                # ORT falls back to the CPU with only a warning; over device pointers that cannot run.
                raise ModelCacheError(f"{name}: onnxruntime could not start the CUDA execution provider "
                                      f"(it offers {self._sess.get_providers()}); check the CUDA and cuDNN "
                                      f"libraries onnxruntime-gpu needs")
            if self._lease.device_uuid:
                # ORT's Python session retries a run that fails in its execution provider on the CPU, re-creating
                # the session (onnxruntime_inference_collection.py, `run`: EPFail -> set_providers): over weights
                # leased on a device that cannot run, so the EP's own error is the one to raise.
                self._sess.disable_fallback()
            overridable = [{"name": i.name, "dtype": NUMPY_TYPES[i.type], "shape": i.shape}
                           for i in self._sess.get_overridable_initializers() if i.type in NUMPY_TYPES]
            self._feed_check = FeedCheck(self._lease.name, self._lease.inputs, overridable)
            _check_asks_for_the_model_inputs(self._sess, self._lease)
        except BaseException:
            for fd in host_fds:
                os.close(fd)
            self.close()
            raise

    def _open(self, name: str, version: int | None, device: str, socket: str | None):
        """The lease, on the caller's client, else on this process's lane (one message, no ZeroMQ:
        client/leases.py), else on this process's full client (a tcp:// daemon, or an older one)."""
        if self._client is None:
            from .leases import NoLaneOpen, shared_lease_client
            self._client = shared_lease_client(socket)
            if self._client is not None:
                try:
                    return self._client.open(name, version, device=device)
                except NoLaneOpen:
                    pass
            from .connection import shared_client
            self._client = shared_client(socket)
        return self._client.open(name, version, device=device)

    # -- the onnxruntime.InferenceSession surface ---------------------------------------
    def run(self, output_names, input_feed: dict, run_options=None):
        if self._sess is None:
            raise InputError("this session is closed")
        outputs = self._sess.run(output_names, self._feed_check.check(input_feed), run_options)
        if self._trim_after_run:     # once: ORT's one-off packings freed (memlimit.release_freed_heap)
            self._trim_after_run = False
            from ..memlimit import release_freed_heap
            release_freed_heap()
        return outputs

    def __getattr__(self, name: str):
        """The rest of onnxruntime.InferenceSession's methods (io_binding, run_with_ort_values,
        get_session_options...): the inner session's, for it is a real ORT session over the shared weights."""
        if name in ORT_SESSION_METHODS:
            if name in _REFUSED_IN_ATTACH_MODE:
                return refusal(name, _REFUSED_IN_ATTACH_MODE[name])
            sess = self.__dict__.get("_sess")
            if sess is None:
                raise InputError("this session is closed")
            return getattr(sess, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def model_name(self) -> str:
        return self._lease.name

    @property
    def model_version(self) -> int:
        return self._lease.version

    @property
    def was_cache_hit(self) -> bool:
        return self._lease.hit

    @property
    def device(self) -> str:
        """Where the weights this session runs on live: "cpu" (host tier) or the GPU's UUID."""
        return self._lease.device_uuid or "cpu"

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Drop the session, then the mapping, then the lease (in that order: ORT points into the mapping)."""
        self._sess = None
        self._weights = []
        if self._lease is not None:   # descriptors of a lease that failed before they were mapped
            from .rpc import close_received_fds
            close_received_fds(self._lease)
        try:
            if self._device_weights is not None:   # after the session: ORT points into these
                weights, self._device_weights = self._device_weights, None
                weights.release()
            for m in self._maps:
                try:
                    m.close()
                except BufferError:
                    pass  # a numpy view of the mapping is still alive; it is unmapped when that view dies
            self._maps = []
        finally:
            # Whatever the device said, the daemon's lease goes: held, it would pin the copy until our heartbeat stops.
            if self._lease is not None and not self._released:
                self._released = True
                try:
                    self._client.release(self._lease.lease_id)
                except Exception:
                    pass  # daemon gone: nothing to release there

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_released", True):
            try:
                self.close()
            except Exception:
                pass


def _take_host_fds(lease) -> list[int]:
    """A host lease's files, when they came as descriptors (the portable skeleton, then each segment:
    protocol.OpenReply.ipc_fds), taken off the lease: now the caller's to close. [] for a GPU lease."""
    if lease.device_uuid:
        return []
    fds, lease.received_fds = getattr(lease, "received_fds", []), []
    return fds


def _host_weights(so, lease, fds: list[int], prepacked: bool) -> tuple:
    """(the model for ORT, mappings, OrtValues) of a host lease, each weight handed to `so` over a read-only mapping.

    Over descriptors (`fds`; closed here) where they came and the pre-packed blobs are not wanted: the portable
    skeleton's bytes and the segments mapped through their descriptors, so no path of the daemon's is opened (a
    client in another container sees none). Else by path: the tier's skeleton, which names the blobs ORT maps."""
    try:
        if fds and not prepacked:
            portable_session_options(so)
            maps, values = bind_weights(so, fds[1:], lease.tensors)
            return read_whole(fds[0]), maps, values
        if not os.path.exists(lease.skeleton_path):   # (ORT would say only that the file does not exist)
            raise ModelCacheError(
                f"{lease.name}: this process cannot see the daemon's host tier ({os.path.dirname(lease.skeleton_path)}"
                "): attach mode maps the daemon's memory, so it runs on the daemon's machine and sees its /dev/shm, or "
                "opens over its ipc:// socket (the lane passes the files as descriptors). A tcp:// daemon elsewhere "
                "runs the model for you: open it with mode='serve'")
        skip = set(lease.prepacked) if prepacked else set()   # ORT maps these, with their blobs
        maps, values = bind_weights(so, lease.segments, [t for t in lease.tensors if t[0] not in skip])
        return lease.skeleton_path, maps, values
    finally:
        for fd in fds:
            os.close(fd)


def _want_prepacked(prepacked: bool | None) -> bool:
    """The caller's choice, else MODELCACHE_PREPACKED (0 turns it off), else on."""
    if prepacked is not None:
        return prepacked
    return os.environ.get("MODELCACHE_PREPACKED", "1").strip().lower() not in ("0", "false", "no", "off")


def _ort_builds() -> str:
    """What to do about an onnxruntime without CUDA: the ORT packages installed say which."""
    from importlib import metadata
    have = []
    for dist in ("onnxruntime", "onnxruntime-gpu"):
        try:
            have.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    if len(have) == 2:   # one onnxruntime/ folder, two packages: the CPU build was written last
        return (f"both {' and '.join(have)} are installed and the CPU build is the one loaded: "
                "pip uninstall -y onnxruntime && pip install --force-reinstall --no-deps onnxruntime-gpu")
    return "install onnxruntime-gpu, the [gpu] extra"


def _device_for(providers, ort) -> str | None:
    """The GPU to lease the weights on ("cuda:<UUID>"), or None for the host tier, from ORT-style providers.

    As onnxruntime does, a CUDA request on an onnxruntime without the CUDA provider falls back to
    the CPU with a warning. MODELCACHE_FAKE_GPUS (simulated GPUs, for tests) counts as CUDA."""
    if not providers:
        return None
    names = [p[0] if isinstance(p, (tuple, list)) else p for p in providers]
    if "CUDAExecutionProvider" not in names:
        return None
    if not os.environ.get("MODELCACHE_FAKE_GPUS") and "CUDAExecutionProvider" not in ort.get_available_providers():
        warnings.warn("Specified provider 'CUDAExecutionProvider' is not in available provider names; "
                      f"modelcache opens the model on the CPU ({_ort_builds()})")
        return None
    from .device import requested_device
    return requested_device(providers)


def _with_provider_options(providers, provider_options):
    """ORT's two ways of giving provider options, as one list of names and (name, options) pairs."""
    if provider_options is None:
        return providers
    if providers is None or len(providers) != len(provider_options):
        raise ValueError("'providers' and 'provider_options' should be the same length if both are given")
    if any(not isinstance(p, str) for p in providers):
        raise ValueError("give provider options either in 'providers' as (name, options) pairs or in "
                         "'provider_options', not both")
    return [(p, dict(o)) for p, o in zip(providers, provider_options)]


def _check_asks_for_the_model_inputs(sess, lease) -> None:
    """A model packed before packing dropped the inputs ORT's optimizer left without values (IR 3
    models: packing.drop_inputs_without_values) asks for them at every run: say how to fix it, once."""
    extra = sorted({i.name for i in sess.get_inputs()} - {i["name"] for i in lease.inputs})
    if extra:
        raise ModelCacheError(f"{lease.name}@{lease.version} was packed by an older modelcache, and its packed "
                              f"graph asks for inputs the model gives values to ({', '.join(extra[:5])}): add the "
                              f"model again (`modelcache add FILE --name {lease.name}`)")
