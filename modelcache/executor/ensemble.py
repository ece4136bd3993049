"""A Triton ensemble's definition: its steps and how tensors flow between them, checked. No I/O.

`input_map` maps a step model's input to the ensemble tensor it takes, `output_map` a step model's output to the
ensemble tensor it makes. A definition is checked as it is made: every step's tensors come from the ensemble's
inputs or an earlier step, every ensemble output is made by a step, no tensor is made twice, no step waits on
itself. The daemon runs it (daemon/ensembles.py); `modelcache import-triton` plans it (triton_repo/ensemble.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..triton_protos.datatypes import numpy_type_of


@dataclass(frozen=True)
class Step:
    model: str
    version: int | None         # None: the model's latest (Triton's model_version -1)
    inputs: tuple               # ((the step model's input, the ensemble tensor it takes), ...)
    outputs: tuple              # ((the step model's output, the ensemble tensor it makes), ...)

    @property
    def label(self) -> str:
        return f"step {self.model!r}" + (f" (version {self.version})" if self.version else "")

    def unmapped(self, inputs: set, outputs: set, model: str) -> str | None:
        """Why the step's maps do not fit its model (`inputs`, `outputs`: the names `model` has), or None."""
        for kind, pairs, names in (("input", self.inputs, inputs), ("output", self.outputs, outputs)):
            for name, _ in pairs:
                if name not in names:
                    return f"{self.label} maps {kind} {name!r}, which {model} does not have (its {kind}s: " \
                           f"{sorted(names)})"
        return None


@dataclass(frozen=True)
class Ensemble:
    name: str
    version: int
    config: dict                # the Triton configuration, as JSON: what ModelConfig answers
    steps: tuple
    owner_uid: int = -1

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"

    @classmethod
    def of(cls, name: str, version: int, config: dict, owner_uid: int = -1) -> "Ensemble":
        """From its configuration; InputError when it is malformed or its steps do not wire up."""
        if not isinstance(config, dict) or config.get("platform") != "ensemble":
            raise InputError(f"{name}: not an ensemble configuration (platform \"ensemble\")")
        try:
            raw = (config.get("ensemble_scheduling") or {}).get("step") or []
            steps = []
            for s in raw:
                step_version = int(s.get("model_version", -1) or -1)
                steps.append(Step(str(s.get("model_name", "")), None if step_version < 1 else step_version,
                                  tuple(sorted((s.get("input_map") or {}).items())),
                                  tuple(sorted((s.get("output_map") or {}).items()))))
            e = cls(name, version, config, tuple(steps), owner_uid)
            e.io("input"), e.io("output")   # (each with a name and dims)
        except (AttributeError, KeyError, TypeError, ValueError) as error:   # (a message's config, not Triton's JSON)
            raise InputError(f"{name}: a malformed ensemble configuration: {error!r}") from None
        if not steps:
            raise InputError(f"{name}: ensemble_scheduling has no step")
        e.order()   # (checks the wiring)
        return e

    @property
    def input_names(self) -> list:
        return [t["name"] for t in self.config.get("input") or []]

    @property
    def output_names(self) -> list:
        return [t["name"] for t in self.config.get("output") or []]

    def io(self, kind: str) -> list[dict]:
        """Its inputs or outputs as a DescribeReply lists a model's ({name, dtype, shape})."""
        batch = int(self.config.get("max_batch_size", 0)) > 0
        return [{"name": t["name"], "dtype": numpy_type_of(t.get("data_type", "")) or "object",
                 "shape": ([-1] if batch else []) + [int(d) for d in t.get("dims") or []]}
                for t in self.config.get(kind) or []]

    def order(self) -> list:
        """The steps in an order where each one's inputs exist before it runs; InputError where none is."""
        made = set(self.input_names)
        makers: dict = {}
        for s in self.steps:
            for _, tensor in s.outputs:
                if tensor in makers or tensor in made:
                    raise InputError(f"{self.name}: ensemble tensor {tensor!r} is made twice (by {s.label} and "
                                     f"{makers[tensor].label if tensor in makers else 'the ensemble inputs'})")
                makers[tensor] = s
        for s in self.steps:
            for _, tensor in s.inputs:
                if tensor not in made and tensor not in makers:
                    raise InputError(f"{self.name}: {s.label} takes ensemble tensor {tensor!r}, which neither the "
                                     "ensemble's inputs nor any step makes")
        missing = [o for o in self.output_names if o not in makers]
        if missing:
            raise InputError(f"{self.name}: ensemble output {missing[0]!r} is made by no step")
        ordered, left = [], list(self.steps)
        while left:
            ready = [s for s in left if all(t in made for _, t in s.inputs)]
            if not ready:
                raise InputError(f"{self.name}: its steps wait on each other ({', '.join(s.label for s in left)}): "
                                 "an ensemble must be a pipeline without cycles")
            for s in ready:
                ordered.append(s)
                left.remove(s)
                made |= {t for _, t in s.outputs}
        return ordered
