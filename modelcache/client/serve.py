"""Serve-mode session: the same `run` as onnxruntime.InferenceSession, executed by the daemon.

This process imports neither onnxruntime nor the model: inputs go to the daemon
(inline, or through a shared-memory file when large), outputs come back inline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..tensors import ORT_TYPES, FeedCheck
from .connection import Client, shared_client

@dataclass(frozen=True)
class NodeArg:
    """What onnxruntime's get_inputs()/get_outputs() return: name, shape, type."""
    name: str
    shape: list
    type: str


class ServeSession:
    def __init__(self, name: str, version: int | None = None, *, client: Client | None = None,
                 socket: str | None = None, deadline_ms: float | None = None):
        self._client = client or shared_client(socket)
        info = self._client.describe(name, version)
        self.model_name, self.model_version = info.name, info.version
        self._inputs, self._outputs, self.stages = info.inputs, info.outputs, info.stages
        self._feed_check = FeedCheck(self.model_name, self._inputs)
        self.deadline_ms = deadline_ms
        self.last_timings: dict = {}
        self._closed = False

    def run(self, output_names, input_feed: dict, run_options=None):
        if self._closed:
            raise InputError("this session is closed")
        feeds = self._feed_check.check(input_feed)
        outputs, self.last_timings = self._client.infer(self.model_name, feeds, output_names,
                                                        self.model_version, self.deadline_ms)
        names = output_names or [o["name"] for o in self._outputs]
        return [outputs[n] for n in names]

    def get_inputs(self):
        return [NodeArg(i["name"], i["shape"], ORT_TYPES.get(i["dtype"], i["dtype"])) for i in self._inputs]

    def get_outputs(self):
        return [NodeArg(o["name"], o["shape"], ORT_TYPES.get(o["dtype"], o["dtype"])) for o in self._outputs]

    def close(self) -> None:
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
