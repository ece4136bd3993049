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
from ..tensors import NUMPY_TYPES, FeedCheck
from ..session_options import attach_session_options, bind_weights

if TYPE_CHECKING:   # connection.py imports pyzmq: a drop-in session on the lane never needs it (client/leases.py)
    from .connection import Client, OpenedModel


class InferenceSession:
    """Same `run`, `get_inputs`, `get_outputs` as `onnxruntime.InferenceSession`; opened by model name.

    mode="attach" (default): ORT runs in this process over the daemon's shared weights.
    mode="serve": the daemon runs the model; this process never imports onnxruntime.
    prepacked: share the model's pre-packed MatMul weights where it has them (default: MODELCACHE_PREPACKED,
    on): warm runs as fast as plain ORT's, at the cost of ORT packing each weight once at session start.
    """

    def __new__(cls, name: str, version: int | None = None, sess_options=None, providers=None, *,
                client: Client | None = None, socket: str | None = None, mode: str = "attach", **kw):
        if mode == "serve":
            from .serve import ServeSession
            kw.pop("prepacked", None)   # the daemon's sessions: not the caller's choice
            return ServeSession(name, version, client=client, socket=socket, **kw)
        if mode != "attach":
            raise ValueError(f"mode must be 'attach' or 'serve', not {mode!r}")
        return super().__new__(cls)

    def __init__(self, name: str, version: int | None = None, sess_options=None, providers=None, *,
                 client: Client | None = None, socket: str | None = None, mode: str = "attach",
                 prepacked: bool | None = None):
        import onnxruntime as ort

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
        self._lease = self._open(name, version, device or "cpu", socket)
        try:
            # Shared pre-packed MatMul weights: faster warm runs, a slower session start (prepack.py).
            self.prepacked = bool(self._lease.prepacked) and not self._lease.device_uuid and _want_prepacked(prepacked)
            so = attach_session_options(sess_options, prepacked=self.prepacked)
            # ORT keeps raw pointers into these mappings: they must outlive the session.
            if self._lease.device_uuid:
                from .device import attach_weights, cuda_first
                self._device_weights = attach_weights(so, self._lease.ipc_kind, self._lease.device_uuid,
                                                      self._lease.ipc_handles, self._lease.tensors)
                if self._lease.ipc_kind != "cuda":   # a simulated GPU: its memory is host memory
                    providers = ["CPUExecutionProvider"]
                else:
                    providers = cuda_first(providers)
            else:
                skip = set(self._lease.prepacked) if self.prepacked else set()   # ORT maps these, with their blobs
                self._maps, self._weights = bind_weights(so, self._lease.segments,
                                                         [t for t in self._lease.tensors if t[0] not in skip])
            self._sess = ort.InferenceSession(self._lease.skeleton_path, so,
                                              providers=providers or ["CPUExecutionProvider"])
            self._trim_after_run = self.prepacked
            if self.prepacked:
                _release_freed_heap()
            if self._lease.ipc_kind == "cuda" and self._sess.get_providers()[0] != "CUDAExecutionProvider":
                # ORT falls back to the CPU with only a warning; over device pointers that cannot run.
                raise ModelCacheError(f"{name}: onnxruntime could not start the CUDA execution provider "
                                      f"(it offers {self._sess.get_providers()}); check the CUDA and cuDNN "
                                      f"libraries onnxruntime-gpu needs")
            overridable = [{"name": i.name, "dtype": NUMPY_TYPES[i.type], "shape": i.shape}
                           for i in self._sess.get_overridable_initializers() if i.type in NUMPY_TYPES]
            self._feed_check = FeedCheck(self._lease.name, self._lease.inputs, overridable)
        except BaseException:
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
        if self._trim_after_run:     # once: see _release_freed_heap
            self._trim_after_run = False
            _release_freed_heap()
        return outputs

    def get_inputs(self):
        return self._sess.get_inputs()

    def get_outputs(self):
        return self._sess.get_outputs()

    def get_overridable_initializers(self):
        return self._sess.get_overridable_initializers()

    def get_modelmeta(self):
        return self._sess.get_modelmeta()

    def get_providers(self):
        return self._sess.get_providers()

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


def _want_prepacked(prepacked: bool | None) -> bool:
    """The caller's choice, else MODELCACHE_PREPACKED (0 turns it off), else on."""
    if prepacked is not None:
        return prepacked
    return os.environ.get("MODELCACHE_PREPACKED", "1").strip().lower() not in ("0", "false", "no", "off")


def _release_freed_heap() -> None:
    """Give back to the OS the heap that ORT's one-off packings (computed to find each shared blob's key,
    then freed) leave behind. glibc's dynamic mmap threshold rises to the size of the large blocks freed,
    so the packings land in the brk heap, and freed heap stays resident: measured, +16 MiB anonymous
    memory after the test's two 16 MiB packings; and for ViT-B/16, in about one session in four, the
    first run made ~310 MiB of that freed heap resident again. Called after session creation and after
    the first run (0.5-90 ms, the most when there is most to give back); later runs stay trimmed."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


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
