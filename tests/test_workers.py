"""Workers: which GPUs get one, and the real worker classes running real stage sessions.

GPU workers, which run over the GPU tier's device memory, are tested with that tier in
tests/test_gpu_serve.py.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import onnxruntime as ort
import pytest

from modelcache import zoo
from modelcache.executor.workers import StageJob, Worker, discover_gpus, gpu_kind, select_gpus
from modelcache.store.packing import pack
from modelcache.tiers.gpu import GpuDevice

A = GpuDevice(0, "GPU-aaaa", "Fake A100", 40 << 30)
B = GpuDevice(1, "GPU-bbbb", "Fake|H100", 80 << 30)


def test_select_gpus_by_setting():
    assert select_gpus("auto", [A, B], cuda_provider=True) == [A, B]
    assert select_gpus("auto", [A, B], cuda_provider=False) == []   # warned: CPU only
    assert select_gpus("auto", [], cuda_provider=False) == []
    assert select_gpus("none", [A, B], cuda_provider=True) == []
    assert select_gpus("1", [A, B], cuda_provider=True) == [B]
    with pytest.raises(ValueError, match="no CUDA device 2 .devices here: 0, 1"):
        select_gpus("0,2", [A, B], cuda_provider=True)
    with pytest.raises(ValueError, match="no CUDA device 0 .devices here: none"):
        select_gpus("0", [], cuda_provider=False)
    with pytest.raises(ValueError, match="no CUDAExecutionProvider"):
        select_gpus("0", [A], cuda_provider=False)
    with pytest.raises(ValueError, match="'auto', 'none' or device indices"):
        select_gpus("first", [A], cuda_provider=True)
    assert gpu_kind(B) == "gpu:Fake/H100"   # '|' separates the saved performance models' fields


def test_discover_gpus_is_clean_on_any_machine():
    found = discover_gpus("auto")
    assert all(isinstance(d, GpuDevice) for d in found)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert found == []
    assert discover_gpus("none") == []


def stage_job(tmp_path, src: str) -> tuple[StageJob, dict]:
    """The whole of a packed model as one stage job over its weights file, as the daemon builds it."""
    manifest = pack(src, tmp_path / "repo", "m", 1)
    model_dir = tmp_path / "repo" / "m" / "1"
    tensors = [[t.name, t.dtype, t.shape, 0, t.offset, t.nbytes] for t in manifest.tensors]
    feeds = zoo.sample_inputs(src)
    job = StageJob(1, "m@1", 0, str(model_dir / "model.onnx"), [str(model_dir / "weights.bin")], tensors,
                   feeds, [o.name for o in manifest.outputs], None)
    return job, feeds


def test_cpu_worker_runs_a_stage_like_plain_ort(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    job, feeds = stage_job(tmp_path, src)
    worker = Worker(0, [0], post=None)
    assert not worker.can_run_inline(job)          # no session yet: the loop must not build one
    assert worker.run(job) is None and worker.can_run_inline(job)
    [want] = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(job.result["outputs"][job.outputs[0]], want, rtol=1e-4, atol=1e-5)


def test_a_short_stage_runs_inline_on_a_single_threaded_session_of_a_multi_core_group(tmp_path, zoo_file):
    """A group of 2 cores runs on its thread with 2 intra-op threads; once a stage the engine marks short has run
    there, the owner loop gets a session of it with one thread (nothing to wake for a run that short)."""
    src = zoo_file("tiny-cnn")
    job, feeds = stage_job(tmp_path, src)
    done = queue.Queue()
    worker = Worker(0, [0, 0], post=lambda job, error: done.put(error))
    worker.start()
    try:
        worker.queue.put(job)                       # not short (never measured): the group's session only
        assert done.get(timeout=60) is None
        assert not worker.can_run_inline(job)
        [session] = worker.sessions.values()
        assert session.session.get_session_options().intra_op_num_threads == 2
        job.short = True                            # predicted within inline_run_ms: its inline session follows
        worker.queue.put(job)
        assert done.get(timeout=60) is None
        worker.drop_model("other@1")                # (a job queued behind the build: it is there once this is done)
        deadline = time.monotonic() + 60
        while worker.drops_done.get("other@1") != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.can_run_inline(job)
        assert job.session.session.get_session_options().intra_op_num_threads == 1
        assert worker.run(job) is None              # what the loop does with it: the same answer
        [want] = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
        np.testing.assert_allclose(job.result["outputs"][job.outputs[0]], want, rtol=1e-4, atol=1e-5)
        worker.drop_model("m@1")                    # a drop takes the inline session with the group's
        while worker.sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not worker.sessions and not worker.can_run_inline(job)
    finally:
        worker.stop()


def test_a_models_own_thread_count_bounds_its_session_and_one_thread_is_its_inline_session(tmp_path, zoo_file):
    """intra_op_thread_count 1 (its Triton config's): the 2-core group runs it on one thread, and the owner loop
    may run it on that same session: no second, single-threaded one is built."""
    src = zoo_file("tiny-cnn")
    job, feeds = stage_job(tmp_path, src)
    job.threads, job.short = 1, True
    worker = Worker(0, [0, 0], post=None)
    assert worker.run(job) is None
    worker._inline_session(job)                 # (what the worker's thread does after a short run)
    [(key, session)] = worker.sessions.items()
    assert key == ("m@1", 0) and session.session.get_session_options().intra_op_num_threads == 1
    assert worker.can_run_inline(job) and job.session is session
    job.session = None
    big = StageJob(2, "m@1", 0, job.skeleton, job.segments, job.tensors, feeds, job.outputs, None, threads=8)
    worker.sessions.clear()                     # (as a drop leaves it: the worker's thread is not running here)
    assert worker.run(big) is None              # more than the group has: the group's cores
    assert worker.sessions[("m@1", 0)].session.get_session_options().intra_op_num_threads == 2


# GPU workers run over the GPU tier's device memory: tests/test_gpu_serve.py.


def test_a_session_whose_drop_is_queued_never_runs_inline():
    """A new partition drops a model's stage sessions through the worker's queue; until the worker has
    done so, the owner loop must not run a job inline on the stale session (seen: 'Invalid output
    name' on the first request after a re-partition, on a loaded machine)."""
    import threading
    from modelcache.executor.workers import StageJob, Worker

    w = Worker(0, [0], post=lambda job, error: None)
    stale = object()
    w.sessions[("m@1", 0)] = stale            # as if the worker had built it for the old stages
    job = StageJob(batch_id=1, model_key="m@1", stage=0, skeleton="", segments=[], tensors=[], inputs={},
                   outputs=[], predicted_s=None)
    assert w.can_run_inline(job) and job.session is stale
    job.session = None
    done = threading.Event()
    w.drop_model("m@1", then=done.set)        # queued: the thread has not started yet
    assert not w.can_run_inline(job) and job.session is None
    w.start()
    try:
        assert done.wait(10)
        assert not w.can_run_inline(job)      # dropped: nothing to run inline until a new session is built
        w.sessions[("m@1", 0)] = fresh = object()
        assert w.can_run_inline(job) and job.session is fresh
    finally:
        w.stop()
