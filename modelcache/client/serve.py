"""Serve-mode session: the same `run` as onnxruntime.InferenceSession, executed by the daemon.

This process imports neither onnxruntime nor the model: inputs go to the daemon
(inline, or through a shared-memory file when large), outputs come back inline.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..wire.tensors import ORT_TYPES, FeedCheck
from .dropin import ORT_SESSION_METHODS, hint_if_a_file, model_name, model_version, refusal
from .leases import NoLaneOpen, shared_lease_client

# What a serve session cannot answer for itself, beyond having no ORT session.
_WHY_NOT_IN_SERVE_MODE = {
    "get_providers": "the daemon chooses a worker, CPU or GPU, for each request (last_timings['stages'] names "
                     "the ones that ran the last one); ",
    "get_modelmeta": "the daemon's description of a model holds its inputs and outputs, not its metadata; ",
}


@dataclass(frozen=True)
class NodeArg:
    """What onnxruntime's get_inputs()/get_outputs() return: name, shape, type."""
    name: str
    shape: list
    type: str


class ServeSession:
    def __init__(self, path_or_name, *, version: int | None = None, client=None,
                 socket: str | None = None, deadline_ms: float | None = None, priority: int | None = None):
        name, version = model_name(path_or_name), model_version(version)
        # The lane alone where the daemon has one (client/leases.py: no pyzmq to import, no hello, no heartbeat),
        # else the full client (a tcp:// daemon); a caller's client as it is.
        self._socket = socket
        self._client = client or shared_lease_client(socket) or self._full_client()
        with hint_if_a_file(path_or_name):
            info = self._client.describe(name, version)
        self.model_name, self.model_version = info.name, info.version
        self._inputs, self._outputs, self.stages = info.inputs, info.outputs, info.stages
        self._overridable = getattr(info, "overridable", None) or []   # (a daemon before they were served: none)
        self._feed_check = FeedCheck(self.model_name, self._inputs, self._overridable)
        self.deadline_ms = deadline_ms
        self.priority = priority   # its requests' priority level, where the model has levels (executor/queues.py)
        self.last_timings: dict = {}
        self._closed = False

    def run(self, output_names, input_feed: dict, run_options=None):
        if self._closed:
            raise InputError("this session is closed")
        feeds = self._feed_check.check(input_feed)
        try:
            outputs, self.last_timings = self._client.infer(self.model_name, feeds, output_names,
                                                            self.model_version, self.deadline_ms, self.priority)
        except NoLaneOpen:   # a daemon that takes no infer without a hello (older than this client): the full one
            self._client = self._full_client()
            return self.run(output_names, input_feed, run_options)
        names = output_names or [o["name"] for o in self._outputs]
        return [outputs[n] for n in names]

    def _full_client(self):
        from .connection import shared_client
        return shared_client(self._socket)

    def get_inputs(self):
        return _node_args(self._inputs)

    def get_outputs(self):
        return _node_args(self._outputs)

    def get_overridable_initializers(self):
        """The initializers a run may feed in place of the stored weights (IR >= 4), as ORT lists them."""
        return _node_args(self._overridable)

    def __getattr__(self, name: str):
        """The rest of onnxruntime.InferenceSession's methods need an ORT session in this process."""
        if name in ORT_SESSION_METHODS:
            return refusal(name, _WHY_NOT_IN_SERVE_MODE.get(name, "") + "in serve mode the daemon runs the model and "
                           "this process has no ORT session; open the model with mode='attach' for it")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _node_args(entries: list[dict]) -> list[NodeArg]:
    """Manifest entries ({name, shape, dtype}) as ORT's NodeArgs, the type in ORT's words."""
    return [NodeArg(e["name"], e["shape"], ORT_TYPES.get(e["dtype"], e["dtype"])) for e in entries]
