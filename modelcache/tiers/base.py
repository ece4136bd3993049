"""The contract every memory tier keeps (host shared memory, each GPU): what a tier's residency manager
(daemon/residency/) asks of it. tests/test_tier_contract.py runs one suite against both, unadapted, and
against the FaaS replay's sizes-only tier (benchmarks/faas/simulate.py) where a test needs no bytes.

Each tier is given, at construction, the tier it is promoted from (`source`: the repository for the
host tier, the host tier for a GPU). A promotion is two-phase, as in ServerlessLLM's store: `plan`
(owner loop: decides where each tensor lives, dedups against what is resident, reserves the bytes) ->
`write` (a loader thread: allocates and copies from the source) -> `commit` or `abort` (owner loop).
A tier frees only when told to (`free_model`): the residency manager decides when, after the copy's
record said nothing holds it (daemon/registry.py). Shared tensors are stored once; a region is freed
when the last model using it goes (the host tier gives back a segment's unused pages before that): both
memory tiers keep their regions in one store, tiers/regions.py.
"""

from __future__ import annotations

from typing import Protocol


class Tier(Protocol):
    name: str                       # "host" or "gpu"
    id: str                         # its copies' key in a model's record: "host", or the GPU's UUID
    where: str                      # for messages: "the host tier", "the GPU tier of GPU 0"
    capacity_setting: str           # the setting that sizes it: host_capacity, gpu_capacity
    capacity_bytes: int

    @property
    def used_bytes(self) -> int:
        """Bytes of every region, those reserved by a plan in flight included."""

    def bytes_freed_by(self, keys) -> int:
        """What freeing all of `keys` together would free: regions no other model uses."""

    def model_bytes(self, key: str) -> int:
        """Bytes of the regions a model uses (shared ones counted in full)."""

    def check_model(self, key: str, manifest) -> None:
        """Raise ModelCacheError when the model can never be in this tier (a GPU's: no GPU variant)."""

    def tensors_of(self, manifest) -> list:
        """The tensors of a model a lease on its copy here maps (this tier's variant of it)."""

    def plan(self, key: str, manifest):
        """Place the model's tensors and reserve their bytes; returns a plan (`plan.bytes`: what it places)."""

    def write(self, plan) -> float:
        """Allocate and copy what `plan` says from the source; a loader thread; returns seconds."""

    def commit(self, plan) -> None:
        """The model is resident: its tensors may be exported."""

    def abort(self, plan) -> None:
        """Release what the plan reserved or wrote; regions other models use stay."""

    def free_model(self, key: str) -> int:
        """Drop a resident model; returns the bytes freed (shared regions free with their last user)."""

    def export(self, key: str, manifest) -> dict:
        """What a lease on a resident model's copy maps, as the open reply's fields (protocol.OpenReply)."""

    def describe(self) -> dict:
        """The tier as `status` lists it (its kind, where it lives), beside its accounting."""
