"""The drop-in `InferenceSession`: an ONNX Runtime session over the daemon's shared weights.

Each weight becomes an OrtValue over a read-only mapping of a shared-memory segment
and is handed to ORT with `add_initializer`, over a skeleton that ORT optimized at add
time. Nothing is read, parsed or copied (benchmarks/binding has the measurement). The
mapping lives as long as this object; the daemon's lease is released on close.
"""

from __future__ import annotations

import mmap
import os

from ..errors import InputError
from ..session_options import attach_session_options
from .connection import Client, OpenedModel, shared_client


def _map_readonly(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)  # the mapping keeps the pages; the descriptor is not needed


class InferenceSession:
    """Same `run`, `get_inputs`, `get_outputs` as `onnxruntime.InferenceSession`; opened by model name."""

    def __init__(self, name: str, version: int | None = None, sess_options=None, providers=None, *,
                 client: Client | None = None, socket: str | None = None):
        import numpy as np
        import onnxruntime as ort

        self._client = client or shared_client(socket)
        self._lease: OpenedModel | None = None
        self._released = False
        self._sess = None
        self._maps: list[mmap.mmap] = []
        self._lease = self._client.open(name, version)
        try:
            self._maps = [_map_readonly(path) for path in self._lease.segments]
            blobs = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
            so = attach_session_options(sess_options)
            self._weights = []  # ORT keeps raw pointers: these OrtValues must outlive the session
            for tname, dtype, shape, segment, offset, nbytes in self._lease.tensors:
                view = blobs[segment][offset:offset + nbytes].view(dtype).reshape(shape)
                value = ort.OrtValue.ortvalue_from_numpy(view)
                self._weights.append(value)
                so.add_initializer(tname, value)
            self._sess = ort.InferenceSession(self._lease.skeleton_path, so,
                                              providers=providers or ["CPUExecutionProvider"])
        except BaseException:
            self.close()
            raise
        self._np = np
        self._inputs = {i["name"]: i for i in self._lease.inputs}

    # -- the onnxruntime.InferenceSession surface ---------------------------------------
    def run(self, output_names, input_feed: dict, run_options=None):
        if self._sess is None:
            raise InputError("this session is closed")
        feeds = self._check_feeds(input_feed)
        return self._sess.run(output_names, feeds, run_options)

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

    # -- input checks: a message a user can act on, before ORT's -------------------------
    def _check_feeds(self, input_feed: dict) -> dict:
        np = self._np
        if not isinstance(input_feed, dict):
            raise InputError(f"input_feed must be a dict of name -> array, not {type(input_feed).__name__}")
        expected = ", ".join(f"{n} ({i['dtype']}, {i['shape']})" for n, i in self._inputs.items())
        unknown = [k for k in input_feed if k not in self._inputs]
        if unknown:
            raise InputError(f"{self._lease.name}: unknown input {unknown[0]!r}; the model takes {expected}")
        missing = [k for k in self._inputs if k not in input_feed]
        if missing:
            raise InputError(f"{self._lease.name}: missing input {missing[0]!r}; the model takes {expected}")
        feeds = {}
        for name, value in input_feed.items():
            spec = self._inputs[name]
            if not isinstance(value, np.ndarray):
                value = np.asarray(value)
            if value.dtype != np.dtype(spec["dtype"]):
                raise InputError(f"{self._lease.name}: input {name!r} must be {spec['dtype']}, got {value.dtype}")
            shape = spec["shape"]
            if value.ndim != len(shape) or any(isinstance(d, int) and d != v for d, v in zip(shape, value.shape)):
                raise InputError(f"{self._lease.name}: input {name!r} must have shape {shape}, "
                                 f"got {list(value.shape)}")
            feeds[name] = value
        return feeds

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
