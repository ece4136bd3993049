"""Which inputs a request must send, as Triton's core decides it (infer_request.cc, ValidateRequestInputs):
every input the model's configuration lists that is not `optional: true`. An optional input left out runs on
what the model holds for it: an overridable initializer's stored weight (Triton's ORT backend serves such an
initializer as an optional input). Models added without a Triton configuration are checked by the engine's own
feed check alone.

And what a request says of its sequence (a stateful model's): Triton's sequence_id, sequence_start and
sequence_end parameters, the same over HTTP and gRPC (`sequence_of`); and its `priority` (`priority_of`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError
from ..wire.protocol import UINT64_MAX, sequence_problem


@dataclass(frozen=True)
class RequiredInputs:
    listed: tuple       # every input the configuration lists
    required: tuple     # those not optional

    @classmethod
    def of(cls, config: dict) -> "RequiredInputs | None":
        inputs = config.get("input") or []
        if not inputs:
            return None
        return cls(tuple(i["name"] for i in inputs), tuple(i["name"] for i in inputs if not i.get("optional")))

    def check(self, model: str, fed) -> None:
        """InputError in Triton's words when a required input is missing or the request sends too many."""
        missing = [n for n in self.required if n not in fed]
        if not missing and len(fed) <= len(self.listed):
            return
        got = "[" + ",".join(f"'{n}'" for n in fed) + "]"
        lacking = "[" + ",".join(f"'{n}'" for n in missing) + "]"
        count = (f"expected {len(self.listed)} inputs" if len(self.required) == len(self.listed) else
                 f"expected number of inputs between {len(self.required)} and {len(self.listed)}")
        raise InputError(f"{count} but got {len(fed)} inputs for model '{model}'. Got input(s) {got}, but missing "
                         f"required input(s) {lacking}. Please provide all required input(s).")


def priority_of(value) -> int | None:
    """A request's priority parameter (Triton's `priority`, from either front): an unsigned 64-bit integer, or None
    when absent. InputError for a value Triton would refuse."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= UINT64_MAX:
        raise InputError(f"parameter priority {value!r}: give an unsigned integer (its priority level, 1 first)")
    return value


def sequence_of(seq_id, start, end) -> dict | None:
    """A request's sequence parameters (Triton's sequence_id, sequence_start, sequence_end, from either front) as
    the daemon takes them; None for a request of no sequence. InputError for values Triton would refuse."""
    why = sequence_problem(seq_id, start, end)
    if why:
        raise InputError(f"parameter {why}")
    if seq_id in (None, 0, "") and not start and not end:
        return None
    return {"id": seq_id, "start": bool(start), "end": bool(end)}
