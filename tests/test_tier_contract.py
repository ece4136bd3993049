"""One contract, two tiers: the host tier (shared memory) and a GPU tier (over the fake allocator) keep the
same promises (modelcache/tiers/base.py), checked by the same tests through the daemon's caches in process.

plan reserves and abort releases; write + commit make a model exportable; a tensor already resident is
stored once; regions free with their last user; a copy under a lease is never freed, and freeing it once
released demotes it to the tier below. (Re-adoption after a restart is the host tier's alone — device
memory dies with its process — and runs against a real daemon in tests/test_restart.py.)
"""

from __future__ import annotations

import pytest

from modelcache.daemon.registry import ModelState
from modelcache.errors import CapacityError
from modelcache.tiers.base import Tier

from daemon_parts import Parts, on_device, resident


class HostSide:
    """The host tier: promoted from the repository; freeing it leaves the model on disk."""

    def __init__(self, parts: Parts):
        self.parts, self.tier = parts, parts.host

    def ready_source(self, model) -> None:
        pass

    def plan(self, model):
        return self.tier.plan(model.key, model.disk_dir, model.manifest, self.parts.cache.host_variants(model))

    def exported(self, model) -> list:
        _, _, tensors = self.tier.export(model.key, model.manifest)
        return tensors

    def variant(self, model) -> list:
        return model.manifest.tensors

    def promote(self, model) -> None:
        resident(self.parts, model)

    def lease(self, client, model):
        return self.parts.registry.grant(client, model, 0.0)

    def evict(self, model) -> None:
        self.parts.cache.evict(model)

    def tier_after_eviction(self, model) -> str:
        return model.tier


class GpuSide:
    """A GPU tier: promoted from the host tier; freeing it demotes the model to the host tier."""

    def __init__(self, parts: Parts):
        self.parts, self.tier = parts, parts.tier

    def ready_source(self, model) -> None:
        resident(self.parts, model)

    def plan(self, model):
        return self.tier.plan(model.key, model.manifest.gpu_tensors, self.parts.host.file_locations(model.key, "gpu"))

    def exported(self, model) -> list:
        _, tensors = self.tier.export(model.key)
        return tensors

    def variant(self, model) -> list:
        return model.manifest.gpu_tensors

    def promote(self, model) -> None:
        on_device(self.parts, model)

    def lease(self, client, model):
        return self.parts.registry.grant(client, model, 0.0, self.parts.uuid)

    def evict(self, model) -> None:
        self.parts.gpu.evict_named(model, "gpu")

    def tier_after_eviction(self, model) -> str:
        return model.tier


@pytest.fixture(params=["host", "gpu"])
def side(request, tmp_path):
    parts = Parts(tmp_path)
    yield (HostSide if request.param == "host" else GpuSide)(parts)
    parts.stop()


def test_both_tiers_keep_the_tier_protocol(side):
    for name in ("name", "capacity_bytes", "used_bytes", "bytes_freed_by", "model_bytes", "write", "commit",
                 "abort", "free_model"):
        assert hasattr(side.tier, name), name
    assert isinstance(side.tier.capacity_bytes, int) and side.tier.name in ("host", "gpu")
    assert {"write", "commit", "abort", "free_model"} <= set(dir(Tier))


def test_plan_reserves_and_abort_releases(side, tmp_path):
    model = side.parts.add(tmp_path, "tiny-cnn", "m")
    side.ready_source(model)
    before = side.tier.used_bytes
    plan = side.plan(model)
    assert side.tier.used_bytes > before            # reserved before a byte is copied
    side.tier.abort(plan)
    assert side.tier.used_bytes == before
    assert side.tier.model_bytes(model.key) == 0


def test_write_and_commit_make_every_tensor_exportable(side, tmp_path):
    model = side.parts.add(tmp_path, "tiny-cnn", "m")
    side.ready_source(model)
    plan = side.plan(model)
    side.tier.write(plan)
    side.tier.commit(plan)
    names = [row[0] for row in side.exported(model)]
    assert sorted(names) == sorted(t.name for t in side.variant(model)) and names
    assert side.tier.model_bytes(model.key) >= sum(t.nbytes for t in side.variant(model)) // 2
    assert side.tier.free_model(model.key) > 0 and side.tier.model_bytes(model.key) == 0


def test_a_tensor_already_resident_is_stored_once(side, tmp_path):
    a = side.parts.add(tmp_path, "tiny-cnn", "a", seed=7)
    b = side.parts.add(tmp_path, "tiny-cnn", "b", seed=7)   # the same weights under another name
    side.promote(a)
    used = side.tier.used_bytes
    side.promote(b)
    assert side.tier.used_bytes == used                      # nothing new copied
    assert side.tier.bytes_freed_by([a.key]) == 0            # b still uses every region
    assert side.tier.bytes_freed_by([a.key, b.key]) == used


def test_regions_free_with_their_last_user(side, tmp_path):
    a = side.parts.add(tmp_path, "tiny-cnn", "a", seed=7)
    b = side.parts.add(tmp_path, "tiny-cnn", "b", seed=7)
    side.promote(a)
    side.promote(b)
    side.evict(a)
    assert side.tier.used_bytes > 0 and side.exported(b)    # b's tensors are where they were
    side.evict(b)
    assert side.tier.model_bytes(b.key) == 0 and side.tier.used_bytes == 0


def test_a_copy_under_a_lease_is_never_freed_and_demotes_once_released(side, tmp_path):
    model = side.parts.add(tmp_path, "tiny-cnn", "m")
    side.promote(model)
    client = side.parts.registry.new_client(1, "c", side.parts.clock())
    lease = side.lease(client, model)
    used = side.tier.used_bytes
    with pytest.raises(CapacityError):
        side.evict(model)
    assert side.tier.used_bytes == used and side.exported(model)
    side.parts.registry.release(lease.lease_id)
    side.parts.cache.after_release(model, lease.device)
    side.evict(model)
    assert side.tier.used_bytes == 0
    assert side.tier_after_eviction(model) == ("disk" if side.tier.name == "host" else "host")
    assert model.state is (ModelState.ON_DISK if side.tier.name == "host" else ModelState.RESIDENT)
