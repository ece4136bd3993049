"""The contract every memory tier keeps (host shared memory, each GPU): what the caches ask of a tier.

A promotion is two-phase, as in ServerlessLLM's store: `plan` (owner loop: decides where each tensor
lives, dedups against what is resident, reserves the bytes) -> `write` (a loader thread: allocates
and copies) -> `commit` or `abort` (owner loop). A tier frees only when told to (`free_model`): the
caches decide when, after the model's record said nothing holds that copy (daemon/registry.py).
Shared tensors are stored once; a region is freed when the last model using it goes. What a plan
starts from differs by tier (the host tier reads the repository, a GPU tier the host tier), so
`plan` is each tier's own; tests/test_tier_contract.py runs one suite against both.
"""

from __future__ import annotations

from typing import Protocol


class Tier(Protocol):
    name: str                       # "host" or "gpu"
    capacity_bytes: int

    @property
    def used_bytes(self) -> int:
        """Bytes of every region, those reserved by a plan in flight included."""

    def bytes_freed_by(self, keys) -> int:
        """What freeing all of `keys` together would free: regions no other model uses."""

    def model_bytes(self, key: str) -> int:
        """Bytes of the regions a model uses (shared ones counted in full)."""

    def write(self, plan) -> float:
        """Allocate and copy what `plan` says; a loader thread; returns seconds."""

    def commit(self, plan) -> None:
        """The model is resident: its tensors may be exported."""

    def abort(self, plan) -> None:
        """Release what the plan reserved or wrote; regions other models use stay."""

    def free_model(self, key: str) -> int:
        """Drop a resident model; returns the bytes freed (shared regions free with their last user)."""
