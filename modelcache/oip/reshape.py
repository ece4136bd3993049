"""Triton's `reshape` (model_configuration.md, "Reshape"): an input or output whose config.pbtxt gives `dims` (what
clients send and get) and `reshape { shape }` (what the model takes or makes). Triton's quickstart model does it
(`densenet_onnx`: clients send [3,224,224], the model takes [1,3,224,224]). Both fronts apply it here, around
the daemon: a request's tensors become the model's shapes before they are sent, the outputs the configured dims
after; metadata says the configured dims. With max_batch_size > 0 the batch dimension stays as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class Reshape:
    inputs: dict          # name -> (dims clients send, the shape the model takes), without the batch dimension
    outputs: dict         # name -> (dims clients get, the shape the model makes)
    batch: bool           # max_batch_size > 0: a batch dimension leads every tensor

    @classmethod
    def of(cls, model_config: dict) -> "Reshape | None":
        """From a model's Triton configuration (as JSON); None when no input or output reshapes."""
        def pairs(entries):
            return {e["name"]: (list(e.get("dims", [])), list(e["reshape"].get("shape", [])))
                    for e in entries or () if "reshape" in e}
        inputs, outputs = pairs(model_config.get("input")), pairs(model_config.get("output"))
        if not inputs and not outputs:
            return None
        return cls(inputs, outputs, int(model_config.get("max_batch_size", 0)) > 0)

    def to_model(self, feeds: dict) -> dict:
        """A request's tensors, shaped as the configuration's dims, in the shapes the model takes."""
        out = dict(feeds)
        for name, (dims, shape) in self.inputs.items():
            arr = feeds.get(name)
            if arr is None:
                continue
            lead = list(arr.shape[:1]) if self.batch else []
            given = list(arr.shape[1:] if self.batch else arr.shape)
            if len(given) != len(dims) or any(d >= 0 and g != d for g, d in zip(given, dims)):
                raise InputError(f"input {name!r}: shape {list(arr.shape)}, where its configuration's dims are "
                                 f"{(['batch'] if self.batch else []) + dims}")
            out[name] = _reshaped(arr, lead + shape, name)
        return out

    def to_client(self, outputs: dict) -> dict:
        """The model's outputs in the shapes the configuration's dims give clients."""
        out = dict(outputs)
        for name, (dims, _) in self.outputs.items():
            arr = outputs.get(name)
            if arr is not None and hasattr(arr, "reshape"):
                out[name] = _reshaped(arr, (list(arr.shape[:1]) if self.batch else []) + dims, name)
        return out

    def metadata(self, tensors: list[dict], kind: str) -> list[dict]:
        """Metadata's tensors (name, datatype, shape) with a reshaped one's shape as its configuration's dims."""
        table = self.inputs if kind == "input" else self.outputs
        return [{**t, "shape": ([-1] if self.batch else []) + table[t["name"]][0]} if t["name"] in table else t
                for t in tensors]


def _reshaped(arr, shape: list, name: str):
    try:
        return arr.reshape(shape)
    except ValueError:
        raise InputError(f"{name!r}: {arr.size} elements of shape {list(arr.shape)} cannot take the shape "
                         f"{shape} its configuration's reshape gives") from None
