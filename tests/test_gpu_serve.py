"""Serve mode on the GPU tier's arena: GPU workers build stage sessions over device memory the daemon holds.

With a fake device (host memory standing in for device memory) the worker runs the code a GPU runs:
OrtValues over the arena's addresses in this process (DLPack, add_initializer on the GPU skeleton),
IOBinding, the crossing tensor kept "on the device" between stages. Checked: no weight is copied per
session (each OrtValue points into the arena, and bytes written into the arena change the outputs),
promotion happens once however many stage sessions, outputs equal plain ONNX Runtime, and a device copy
a worker may still run on is never freed. The CUDA form is the `gpu`-marked test at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from modelcache import zoo
from modelcache.errors import CapacityError
from modelcache.executor.partition import partition
from modelcache.executor.workers import DeviceValue, GpuWorker, StageJob, Worker, WorkerUnavailable, discover_gpus
from modelcache.store.format import load_manifest
from modelcache.store.packing import pack
from modelcache.tiers import gpu

from conftest import HERE, DaemonProcess, stop_cleanly, wait_until


def plain(src: str, feeds: dict) -> list:
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


class Arena:
    """A packed model (optionally cut in stages) promoted to one device tier, as the daemon holds it."""

    def __init__(self, tmp_path: Path, src: str, allocator, stages: int = 1):
        self.model_dir = tmp_path / "repo" / "m" / "1"
        pack(src, tmp_path / "repo", "m", 1)
        if stages > 1:
            partition(self.model_dir, stages=stages, gpu=True)
        self.manifest = load_manifest(self.model_dir)
        self.tier = gpu.DeviceTier(allocator, allocator.device.total_bytes)
        blob = str(self.model_dir / "weights.bin")   # (the host tier's segment, in the daemon)
        plan = self.tier.plan_tensors("m@1", self.manifest.gpu_tensors, {t.name: (blob, t.offset)
                                                                 for t in self.manifest.gpu_tensors})
        with ThreadPoolExecutor(1) as loader:        # write runs on a loader thread, as in the daemon
            loader.submit(self.tier.write, plan).result()
        self.tier.commit(plan)
        self.uuid = allocator.device.uuid

    def stage_specs(self) -> list[dict]:
        """What the daemon hands a request for this device (serving.py, _serve_device_specs)."""
        if not self.manifest.stages:
            return [{"uuid": self.uuid, "skeleton": str(self.model_dir / "model.gpu.onnx"),
                     "tensors": self.tier.local_tensors("m@1")}]
        return [{"uuid": self.uuid, "skeleton": str(self.model_dir / e["gpu_file"]),
                 "tensors": self.tier.local_tensors("m@1", set(e["gpu_tensors"]))} for e in self.manifest.stages]

    def cpu_job(self, stage: int, inputs: dict) -> StageJob:
        """The same stage for a CPU worker, over the host copy of the weights."""
        stages = self.manifest.stages or [{"file": "model.onnx", "outputs": [o.name for o in self.manifest.outputs],
                                           "tensors": [t.name for t in self.manifest.tensors]}]
        e = stages[stage]
        tensors = [[t.name, t.dtype, t.shape, 0, t.offset, t.nbytes] for t in self.manifest.tensors
                   if t.name in set(e["tensors"])]
        return StageJob(1, "m@1", stage, str(self.model_dir / e["file"]), [str(self.model_dir / "weights.bin")],
                        tensors, inputs, e["outputs"], None)

    def gpu_job(self, stage: int, inputs: dict) -> StageJob:
        job = self.cpu_job(stage, inputs)
        job.device = self.stage_specs()[stage]
        job.keep_on_device = stage + 1 < max(1, len(self.manifest.stages))
        return job


@pytest.fixture
def fake_allocator(tmp_path):
    allocator = gpu.FakeAllocator(gpu.fake_devices("64M")[0], tmp_path / "fake-gpu")
    yield allocator


def test_a_gpu_worker_runs_over_the_arena_without_copying_the_weights(tmp_path, zoo_file, fake_allocator):
    src = zoo_file("tiny-cnn")
    arena = Arena(tmp_path, src, fake_allocator)
    feeds = zoo.sample_inputs(src)
    worker = GpuWorker(1, fake_allocator.device, post=None)
    job = arena.gpu_job(0, feeds)
    assert worker.run(job) is None, job.result
    [want] = plain(src, feeds)
    np.testing.assert_allclose(job.result["outputs"][job.outputs[0]], want, rtol=1e-4, atol=1e-5)
    assert not isinstance(job.result["outputs"][job.outputs[0]], DeviceValue)   # the answer: in host memory

    # Every weight of the session is an OrtValue over the arena's bytes in this process ...
    [allocation] = [a.allocation for a in arena.tier.arenas.values()]
    base = fake_allocator.local_address(allocation)
    stage = worker.sessions[("m@1", 0)]
    assert stage.values and all(base <= v.data_ptr() < base + allocation.nbytes for v in stage.values)
    assert sorted(v.data_ptr() for v in stage.values) == sorted(t[3] for t in job.device["tensors"])
    # ... so what the arena holds is what the session computes with: no copy was taken.
    path = fake_allocator.path(allocation)
    original = path.read_bytes()
    path.write_bytes(bytes(len(original)))
    again = arena.gpu_job(0, feeds)
    assert worker.run(again) is None
    assert not np.allclose(again.result["outputs"][job.outputs[0]], want)
    path.write_bytes(original)
    arena.tier.stop()


def test_consecutive_stages_on_one_device_keep_the_crossing_tensor_there(tmp_path, zoo_file, fake_allocator):
    src = zoo_file("tiny-vit")
    arena = Arena(tmp_path, src, fake_allocator, stages=2)
    assert [bool(e.get("gpu_file")) for e in arena.manifest.stages] == [True, True]
    assert arena.manifest.stages[0]["outputs"] == arena.manifest.stages[1]["inputs"]
    feeds = zoo.sample_inputs(src)
    want = plain(src, feeds)
    gpu_worker, cpu_worker = GpuWorker(1, fake_allocator.device, post=None), Worker(0, [0], post=None)

    first = arena.gpu_job(0, feeds)
    assert first.keep_on_device and gpu_worker.run(first) is None
    [crossing] = first.result["outputs"].values()
    assert isinstance(crossing, DeviceValue) and crossing.device == "fake-0" and crossing.nbytes > 0
    second = arena.gpu_job(1, first.result["outputs"])
    assert not second.keep_on_device and gpu_worker.run(second) is None
    np.testing.assert_allclose(next(iter(second.result["outputs"].values())), want[0], rtol=1e-4, atol=1e-5)
    assert len(gpu_worker.sessions) == 2 and len(arena.tier.arenas) == 1   # two sessions, one arena

    # Across devices: the value comes to host memory for a CPU stage, and host arrays go to the GPU.
    to_cpu = arena.cpu_job(1, first.result["outputs"])
    assert cpu_worker.run(to_cpu) is None
    np.testing.assert_allclose(next(iter(to_cpu.result["outputs"].values())), want[0], rtol=1e-4, atol=1e-5)
    on_cpu = arena.cpu_job(0, feeds)
    assert cpu_worker.run(on_cpu) is None
    to_gpu = arena.gpu_job(1, on_cpu.result["outputs"])
    assert gpu_worker.run(to_gpu) is None
    np.testing.assert_allclose(next(iter(to_gpu.result["outputs"].values())), want[0], rtol=1e-4, atol=1e-5)
    gpu_worker.sessions.clear()
    arena.tier.stop()


def test_a_gpu_worker_refuses_a_stage_without_device_weights(tmp_path, zoo_file, fake_allocator):
    src = zoo_file("tiny-cnn")
    arena = Arena(tmp_path, src, fake_allocator)
    error = GpuWorker(1, fake_allocator.device, post=None).run(arena.cpu_job(0, zoo.sample_inputs(src)))
    assert error is not None and "without its weights on device fake-0" in str(error)
    arena.tier.stop()


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(),
                    reason="onnxruntime has the CUDA provider here: the refusal cannot be shown")
def test_a_cuda_gpu_worker_without_a_cuda_provider_refuses_clearly(tmp_path, zoo_file, fake_allocator):
    src = zoo_file("tiny-cnn")
    arena = Arena(tmp_path, src, fake_allocator)
    device = gpu.GpuDevice(0, "GPU-aaaa", "Fake A100", 40 << 30)
    worker = GpuWorker(3, device, post=None)
    job = arena.gpu_job(0, zoo.sample_inputs(src))
    job.device = {**job.device, "uuid": "GPU-aaaa"}
    error = worker.run(job)     # ORT itself would quietly fall back to the CPU
    assert isinstance(error, WorkerUnavailable) and "CUDA" in str(error)
    assert not worker.sessions and not worker.can_run_inline(job)
    arena.tier.stop()


# -- the daemon -------------------------------------------------------------------------------------

@pytest.fixture
def serving_gpu(tmp_path, monkeypatch):
    """A daemon with one CPU group and one simulated GPU, whose serve-mode sessions idle out after 5 s
    (long enough that a test sees them held right after its requests, even on a busy machine)."""
    env = {"MODELCACHE_FAKE_GPUS": "1x64M", "MODELCACHE_WORKERS": "1", "MODELCACHE_SERVE_IDLE_S": "5",
           "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.5"}
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    d = DaemonProcess(tmp_path, env).start()
    yield d
    stop_cleanly(d)


def gpu_info(client, name) -> list:
    return next(m for m in client.list() if m["name"] == name)["gpu"]


def test_serve_requests_run_on_the_fake_gpu_over_one_promotion(serving_gpu, zoo_file):
    src = zoo_file("tiny-vit")
    with serving_gpu.client() as c:
        c.add(src, "vit")
        c.partition("vit", stages=2)
        feeds = zoo.sample_inputs(src)
        want = plain(src, feeds)
        kinds = []
        for _ in range(8):
            out, timings = c.infer("vit", feeds)
            np.testing.assert_allclose(next(iter(out.values())), want[0], rtol=1e-4, atol=1e-5)
            kinds.append(tuple(s["kind"] for s in timings["stages"]))
        # dmda explores both kinds; stages on the fake GPU ran over its arena
        assert ("gpu:fake-gpu", "gpu:fake-gpu") in kinds, kinds
        st = c.stats()
        assert st.counters["gpu_promotions"] == 1          # one promotion for every request and stage session
        # The engine holds a lease on the device copy while its GPU worker may have sessions over it.
        assert gpu_info(c, "vit") == [{"device": "fake-0", "state": "resident", "leases": 1}]
        with pytest.raises(CapacityError, match="serve-mode GPU workers"):
            c.evict("vit", tier="gpu")
        with pytest.raises(CapacityError, match="in use"):
            c.evict("vit")
        c.partition("vit", stages=2)    # the workers' holds do not stop a new partition: their sessions go
        out, _ = c.infer("vit", feeds)
        np.testing.assert_allclose(next(iter(out.values())), want[0], rtol=1e-4, atol=1e-5)
        # Idle serve sessions are dropped; the worker's lease goes with them, and the copy can be demoted.
        wait_until(lambda: gpu_info(c, "vit")[0]["leases"] == 0, timeout_s=30, what="the GPU worker's lease released")
        c.evict("vit", tier="gpu")
        assert gpu_info(c, "vit") == []
        assert not list(serving_gpu.shm_dir.glob("fake-gpu-0/*"))   # the arena itself is gone
        out, _ = c.infer("vit", feeds)                      # promoted again, served again
        np.testing.assert_allclose(next(iter(out.values())), want[0], rtol=1e-4, atol=1e-5)
        assert c.stats().counters["gpu_promotions"] == 2


def test_a_serve_mode_client_with_gpus_imports_no_onnxruntime(serving_gpu, zoo_file, tmp_path):
    src = zoo_file("tiny-cnn")
    with serving_gpu.client() as c:
        c.add(src, "cnn")
    feeds = zoo.sample_inputs(src)
    np.savez(tmp_path / "refs.npz", cnn=plain(src, feeds)[0])
    np.savez(tmp_path / "refs-cnn-feeds.npz", **feeds)
    env = {**os.environ, "MODELCACHE_SOCKET": serving_gpu.socket}
    r = subprocess.run([sys.executable, str(HERE / "client_worker.py"), "serve", str(tmp_path / "refs.npz"), "6"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == '{"wrong": 0, "onnxruntime_imported": false}'
    with serving_gpu.client() as c:
        assert any(w["device"] == "fake-0" for w in c.stats().executor["workers"])


# -- on a GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.cuda_ep
def test_a_gpu_worker_runs_two_stages_over_cuda_device_memory(tmp_path, zoo_file):
    devices = gpu.probe()
    if not devices or not discover_gpus("auto"):
        pytest.skip("no CUDA device with cupy and onnxruntime-gpu here")
    src = zoo_file("tiny-vit")
    allocator = gpu.CudaAllocator(devices[0])
    arena = Arena(tmp_path, src, allocator, stages=2)
    feeds = zoo.sample_inputs(src)
    worker = GpuWorker(1, devices[0], post=None)
    try:
        first = arena.gpu_job(0, feeds)
        assert worker.run(first) is None, first
        [crossing] = first.result["outputs"].values()
        assert isinstance(crossing, DeviceValue) and crossing.value.device_name().lower() == "cuda"
        second = arena.gpu_job(1, first.result["outputs"])
        assert worker.run(second) is None
        stage = worker.sessions[("m@1", 0)]
        assert sorted(v.data_ptr() for v in stage.values) == sorted(t[3] for t in first.device["tensors"])
        np.testing.assert_allclose(next(iter(second.result["outputs"].values())), plain(src, feeds)[0],
                                   rtol=1e-3, atol=1e-4)
    finally:
        worker.sessions.clear()
        arena.tier.stop()


def test_eager_eviction_waits_for_the_gpu_workers_sessions(tmp_path, monkeypatch, zoo_file):
    """With `eager`, a model goes as soon as nothing holds it: for a GPU worker's model, once its sessions are gone."""
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    d = DaemonProcess(tmp_path, {"MODELCACHE_FAKE_GPUS": "1x64M", "MODELCACHE_WORKERS": "1",
                                 "MODELCACHE_SERVE_IDLE_S": "5", "MODELCACHE_HEARTBEAT_INTERVAL_S": "0.25",
                                 "MODELCACHE_EVICTION_POLICY": "eager"}).start()
    try:
        src = zoo_file("tiny-cnn")
        with d.client() as c:
            c.add(src, "cnn")
            feeds = zoo.sample_inputs(src)
            for _ in range(4):      # the third runs on the fake GPU (dmda explores it)
                out, timings = c.infer("cnn", feeds)
                np.testing.assert_allclose(out["logits"], plain(src, feeds)[0], rtol=1e-4, atol=1e-5)
            assert gpu_info(c, "cnn")[0]["leases"] == 1     # the worker's: the model stays while it may run
            wait_until(lambda: next(m for m in c.list() if m["name"] == "cnn")["tier"] == "disk", timeout_s=30,
                       what="the model evicted once the GPU worker's sessions were dropped")
            assert not list(d.shm_dir.glob("fake-gpu-0/*"))
    finally:
        stop_cleanly(d)
