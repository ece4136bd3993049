"""The drop-in `InferenceSession`: an ONNX Runtime session over the daemon's shared weights.

Each weight becomes an OrtValue over a read-only mapping of a shared-memory segment
and is handed to ORT with `add_initializer`, over a skeleton that ORT optimized at add
time. Nothing is read, parsed or copied (benchmarks/binding has the measurement). The
mapping lives as long as this object; the daemon's lease is released on close.
"""

from __future__ import annotations


from ..errors import InputError
from ..tensors import FeedCheck
from ..session_options import attach_session_options, bind_weights
from .connection import Client, OpenedModel, shared_client


class InferenceSession:
    """Same `run`, `get_inputs`, `get_outputs` as `onnxruntime.InferenceSession`; opened by model name.

    mode="attach" (default): ORT runs in this process over the daemon's shared weights.
    mode="serve": the daemon runs the model; this process never imports onnxruntime.
    """

    def __new__(cls, name: str, version: int | None = None, sess_options=None, providers=None, *,
                client: Client | None = None, socket: str | None = None, mode: str = "attach", **kw):
        if mode == "serve":
            from .serve import ServeSession
            return ServeSession(name, version, client=client, socket=socket, **kw)
        if mode != "attach":
            raise ValueError(f"mode must be 'attach' or 'serve', not {mode!r}")
        return super().__new__(cls)

    def __init__(self, name: str, version: int | None = None, sess_options=None, providers=None, *,
                 client: Client | None = None, socket: str | None = None, mode: str = "attach"):
        import onnxruntime as ort

        self._client = client or shared_client(socket)
        self._lease: OpenedModel | None = None
        self._released = False
        self._sess = None
        self._maps: list = []
        self._lease = self._client.open(name, version)
        try:
            so = attach_session_options(sess_options)
            # ORT keeps raw pointers into these mappings: they must outlive the session.
            self._maps, self._weights = bind_weights(so, self._lease.segments, self._lease.tensors)
            self._sess = ort.InferenceSession(self._lease.skeleton_path, so,
                                              providers=providers or ["CPUExecutionProvider"])
            self._feed_check = FeedCheck(self._lease.name, self._lease.inputs)
        except BaseException:
            self.close()
            raise

    # -- the onnxruntime.InferenceSession surface ---------------------------------------
    def run(self, output_names, input_feed: dict, run_options=None):
        if self._sess is None:
            raise InputError("this session is closed")
        return self._sess.run(output_names, self._feed_check.check(input_feed), run_options)

    def get_inputs(self):
        return self._sess.get_inputs()

    def get_outputs(self):
        return self._sess.get_outputs()

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

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Drop the session, then the mapping, then the lease (in that order: ORT points into the mapping)."""
        self._sess = None
        self._weights = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:
                pass  # a numpy view of the mapping is still alive; it is unmapped when that view dies
        self._maps = []
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
