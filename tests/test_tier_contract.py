"""One contract, three tiers: the host tier (shared memory), a GPU tier (over the fake allocator) and the FaaS
replay's sizes-only tier (benchmarks/faas/simulate.py) keep the same promises (modelcache/tiers/base.py),
checked by the same tests with the same calls, through the one residency manager type (daemon/residency/)
each tier has; no adapter stands between a test and a tier. The sizes-only tier holds no bytes: what needs
bytes (a source to copy from, tensors to export, tensors to share) is checked on the other two alone, and a
test that is only that skips there, saying so.

plan reserves and abort releases; write + commit make a model exportable; a tensor already resident is
stored once; regions free with their last user; a copy under a lease is never freed, and freeing it once
released demotes it to the tier below. (Re-adoption after a restart is the host tier's alone — device
memory dies with its process — and runs against a real daemon in tests/test_restart.py.)
"""

from __future__ import annotations

import pytest

from benchmarks.faas.simulate import Replay, SizesTier, trace_policy
from modelcache import zoo
from modelcache.daemon.residency import ModelState
from modelcache.errors import CapacityError
from modelcache.tiers.base import Tier

from daemon_parts import MiB, Parts, resident


class ReplayParts:
    """The FaaS replay's parts, as `Parts` offers the daemon's to these tests: its sizes-only tier under the
    residency manager, on the replay's virtual loaders and clock. A model's size is its zoo graph's weights."""

    def __init__(self, capacity_bytes: int = 256 * MiB):
        self.replay = Replay(trace_policy("lru"), capacity_bytes, {})
        self.registry, self.residency = self.replay.registry, self.replay.residency
        self.loaders = self           # `resident` settles the loads: here, the replay's events

    def clock(self) -> float:
        return self.replay.now

    def settle(self) -> None:
        self.replay.run(())           # no calls: the events queued (loads landing) run, in time order

    def add(self, tmp_path, zoo_name: str, name: str, seed: int = 0):
        graph = zoo.build(zoo_name, seed).graph
        return self.replay.add(name, sum(len(t.raw_data) for t in graph.initializer))

    lease = Parts.lease               # (they ask only the residency manager, with the clock)
    release = Parts.release

    def stop(self) -> None:
        pass


@pytest.fixture(params=["host", "gpu", "sizes"])
def side(request, tmp_path):
    """(parts, the tier's residency manager): the host tier's, the GPU's above it, or the replay's."""
    if request.param == "sizes":
        parts = ReplayParts()
        yield parts, parts.residency
        return
    parts = Parts(tmp_path)
    yield parts, (parts.residency if request.param == "host" else parts.device)
    parts.stop()


def holds_bytes(tier) -> bool:
    """Whether the tier holds the weights themselves (copies them from a source, exports their places), not
    only their sizes."""
    return not isinstance(tier, SizesTier)


def below_ready(parts, residency, model) -> None:
    """A copy is promoted from the tier below: have it there (the host tier's source, the repository, always is)."""
    if residency.below is not None:
        resident(parts, model, residency.below)


def test_both_tiers_keep_the_tier_protocol(side):
    _, residency = side
    tier = residency.tier
    for name in ("name", "id", "where", "capacity_setting", "capacity_bytes", "used_bytes", "bytes_freed_by",
                 "model_bytes", "check_model", "tensors_of", "plan", "write", "commit", "abort", "free_model",
                 "export", "describe"):
        assert hasattr(tier, name), name
    assert isinstance(tier.capacity_bytes, int) and tier.name in ("host", "gpu")
    assert not holds_bytes(tier) or tier.source is not None      # (sizes are copied from nowhere)
    assert {"plan", "write", "commit", "abort", "free_model", "export"} <= set(dir(Tier))


def test_plan_reserves_and_abort_releases(side, tmp_path):
    parts, residency = side
    tier, model = residency.tier, parts.add(tmp_path, "tiny-cnn", "m")
    below_ready(parts, residency, model)
    before = tier.used_bytes
    plan = tier.plan(model.key, model.manifest)
    assert tier.used_bytes == before + plan.bytes > before     # reserved before a byte is copied
    tier.abort(plan)
    assert tier.used_bytes == before
    assert tier.model_bytes(model.key) == 0


def test_write_and_commit_make_every_tensor_exportable(side, tmp_path):
    parts, residency = side
    if not holds_bytes(residency.tier):
        pytest.skip("a sizes-only tier holds no tensors: it exports none (export is {}, tensors_of [])")
    tier, model = residency.tier, parts.add(tmp_path, "tiny-cnn", "m")
    below_ready(parts, residency, model)
    plan = tier.plan(model.key, model.manifest)
    tier.write(plan)
    tier.commit(plan)
    lease_fields = tier.export(model.key, model.manifest)
    names = [row[0] for row in lease_fields["tensors"]]
    assert sorted(names) == sorted(t.name for t in tier.tensors_of(model.manifest)) and names
    assert lease_fields["skeleton_path"]
    assert tier.model_bytes(model.key) >= sum(t.nbytes for t in tier.tensors_of(model.manifest)) // 2
    assert tier.free_model(model.key) > 0 and tier.model_bytes(model.key) == 0


def test_a_tensor_already_resident_is_stored_once(side, tmp_path):
    parts, residency = side
    if not holds_bytes(residency.tier):
        pytest.skip("a sizes-only tier knows a model's size, not its tensors: two models never share (nor do the "
                    "replay's, each its own copy)")
    tier = residency.tier
    a = parts.add(tmp_path, "tiny-cnn", "a", seed=7)
    b = parts.add(tmp_path, "tiny-cnn", "b", seed=7)   # the same weights under another name
    resident(parts, a, residency)
    used = tier.used_bytes
    resident(parts, b, residency)
    assert tier.used_bytes == used                      # nothing new copied
    assert tier.bytes_freed_by([a.key]) == 0            # b still uses every region
    assert tier.bytes_freed_by([a.key, b.key]) == used


def test_regions_free_with_their_last_user(side, tmp_path):
    parts, residency = side
    tier = residency.tier
    a = parts.add(tmp_path, "tiny-cnn", "a", seed=7)
    b = parts.add(tmp_path, "tiny-cnn", "b", seed=7)
    resident(parts, a, residency)
    resident(parts, b, residency)
    residency.evict(a)
    assert tier.used_bytes > 0
    assert not holds_bytes(tier) or tier.export(b.key, b.manifest)["tensors"]   # b's tensors are where they were
    residency.evict(b)
    assert tier.model_bytes(b.key) == 0 and tier.used_bytes == 0


def test_a_copy_under_a_lease_is_never_freed_and_demotes_once_released(side, tmp_path):
    parts, residency = side
    tier, model = residency.tier, parts.add(tmp_path, "tiny-cnn", "m")
    resident(parts, model, residency)
    client = parts.registry.new_client(1, "c", parts.clock())
    lease = parts.lease(client, model, residency)
    used = tier.used_bytes
    with pytest.raises(CapacityError):
        residency.evict(model)
    assert tier.used_bytes == used
    assert not holds_bytes(tier) or tier.export(model.key, model.manifest)["tensors"]
    parts.release(lease)
    residency.evict(model)
    assert tier.used_bytes == 0
    assert model.tier == ("disk" if residency.below is None else residency.below.tier.name)
    assert model.state is (ModelState.ON_DISK if residency.below is None else ModelState.RESIDENT)
