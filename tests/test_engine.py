"""The serve engine driven by hand: a fake clock and workers that run nothing until told to.

Each fake stage doubles its input rows, so every answer shows which rows it got back.
"""

from __future__ import annotations

import numpy as np
import pytest

from modelcache.config import Settings
from modelcache.errors import CapacityError, RequestTimeout, RunError
from modelcache.executor.engine import Engine, ServeRequest
from modelcache.executor.scheduler import WorkerState

STAGES = [{"skeleton": "", "inputs": ["x"], "outputs": ["h"], "tensors": []},
          {"skeleton": "", "inputs": ["h"], "outputs": ["y"], "tensors": []}]
ONE_STAGE = [{"skeleton": "", "inputs": ["x"], "outputs": ["y"], "tensors": []}]

class FakeWorker:
    def __init__(self, worker_id, cores, post):
        self.state = WorkerState(worker_id, kind=f"cpu{len(cores)}")
        self.cores, self.post, self.jobs = cores, post, []
        self.queue = self   # the engine puts jobs here

    def put(self, job):
        self.jobs.append(job)

    def can_run_inline(self, job):
        return True                     # (a real worker: once its thread built the session)

    def drop_model(self, model_key, then=None):
        if then is not None:
            then()

    def run(self, job, seconds: float = 0.01):
        job.worker_id = self.state.worker_id
        [name] = job.outputs
        try:                            # as a real worker: a failed run is returned, not raised
            job.result = {"outputs": {name: next(iter(job.inputs.values())) * 2}, "run_s": seconds}
        except Exception as e:
            return e
        return None

    def run_next(self, seconds: float = 0.01):
        job = self.jobs.pop(0)
        self.post(job, self.run(job, seconds))
        return job


class Harness:
    def __init__(self, policy: str, **settings):
        self.now = 0.0
        self.answers = {}
        settings = {"workers": "2", **settings}
        self.engine = Engine(Settings(socket="ipc:///unused", repository="/unused", scheduler="eager",
                                      batching=policy, **settings),
                             None, post=self.post, clock=lambda: self.now, worker_factory=FakeWorker)
        self.worker = self.engine.workers[0]

    def post(self, fn, result, error):
        """A worker's result, as the daemon's loop applies it: then the turn's step."""
        fn(result, error)
        self.engine.step()

    def submit(self, tag, rows, deadline=None, profile=None, stages=STAGES, x=None, serving=None, priority=None):
        def finish(outputs, timings, error, tag=tag):
            self.answers[tag] = (outputs, timings, error)
        if x is None:
            x = np.arange(rows, dtype=np.float32).reshape(rows, 1) + 100 * tag
        self.engine.submit(ServeRequest("m@1", stages, [], {"x": x}, None, self.now, deadline, finish,
                                        samples=rows, batchable=True, profile=profile, serving=serving,
                                        priority=priority))
        self.engine.step()   # (as the daemon's loop does once a turn)

    def y(self, tag):
        outputs, _, error = self.answers[tag]
        assert error is None, error
        return outputs["y"]


def expected(tag, rows):
    return (np.arange(rows, dtype=np.float32).reshape(rows, 1) + 100 * tag) * 4


def test_a_request_that_expires_in_the_queue_is_answered_and_the_next_one_runs():
    h = Harness("serial")
    h.submit(1, 1)
    h.submit(2, 1, deadline=0.005)
    h.submit(3, 1)
    h.now = 0.010
    h.worker.run_next()
    h.worker.run_next()                 # request 1 done; 2 has expired, 3 takes the worker
    assert isinstance(h.answers[2][2], RequestTimeout)
    assert h.engine.describe()["models"]["m@1"]["rejected"] == 1   # (its deadline passed: it never ran)
    assert [j.batch_id for j in h.worker.jobs] and h.worker.jobs[0].inputs["x"][0, 0] == 300
    h.worker.run_next()
    h.worker.run_next()
    np.testing.assert_array_equal(h.y(3), expected(3, 1))
    assert not h.engine.requests and not h.engine.queues


def test_a_full_queue_refuses_at_once_and_its_model_may_set_its_own_bound():
    h = Harness("serial", workers="1", max_queue=2)
    h.submit(1, 1)                      # runs: the worker is busy from now
    h.submit(2, 1)
    h.submit(3, 1)                      # two wait: the setting's bound
    h.submit(4, 1)
    error = h.answers[4][2]
    assert isinstance(error, CapacityError) and "Exceeds maximum queue size (2)" in str(error), error
    assert 2 not in h.answers and 3 not in h.answers
    h.submit(5, 1, serving={"max_queue": 3})   # the model's own bound (its Triton config's) wins
    for _ in range(8):                  # 1, 2, 3 and 5, two stages each, one at a time
        h.worker.run_next()
    for tag in (1, 2, 3, 5):
        np.testing.assert_array_equal(h.y(tag), expected(tag, 1))
    assert h.engine.describe()["refused"] == {"queue_full": 1, "queue_timeout": 0}
    stats = h.engine.describe()["models"]["m@1"]   # a refusal is the model's failure, REJECTED in Triton's metrics
    assert (stats["failed"], stats["rejected"], stats["success"]) == (1, 1, 4)
    h.engine.settings.max_queue = 0     # no bound (the default): a live setting
    for tag in range(6, 12):
        h.submit(tag, 1)
    assert not any(h.answers.get(tag) for tag in range(6, 12)) and len(h.engine.queues["m@1"]) == 5


def test_a_request_queued_past_its_models_queue_timeout_is_refused_and_never_runs():
    h = Harness("serial", workers="1")
    own = {"queue_timeout_ms": 5.0}
    h.submit(1, 1, serving=own)         # runs at once: never queued, never timed out
    h.now = 0.002
    h.submit(2, 1, serving=own)         # queued from 2 ms: refused after 7 ms
    h.submit(3, 1, serving=own, deadline=1.0)
    h.now = 0.006
    h.worker.run_next()                 # 1's first stage done at 6 ms: 2 and 3 still in time
    assert 2 not in h.answers and 3 not in h.answers
    h.now = 0.0071
    h.worker.run_next()                 # 1 answered at 7.1 ms: 2 and 3 waited past their 5 ms
    np.testing.assert_array_equal(h.y(1), expected(1, 1))
    for tag in (2, 3):
        error = h.answers[tag][2]
        assert isinstance(error, CapacityError) and "Request timeout expired" in str(error), error
    assert not h.worker.jobs and not h.engine.requests
    assert h.engine.describe()["refused"] == {"queue_full": 0, "queue_timeout": 2}
    assert h.engine.describe()["models"]["m@1"]["rejected"] == 2
    # with the worker busy, the engine's timer answers a timed-out request at its time
    h.submit(4, 1, serving=own)         # runs
    h.submit(5, 1, serving=own)         # waits from 7.1 ms
    assert h.engine.next_wakeup() == pytest.approx(0.0121)
    h.now = 0.0125
    h.engine.on_timer(h.now)
    assert isinstance(h.answers[5][2], CapacityError) and 4 not in h.answers


def test_a_lone_request_on_an_idle_engine_starts_at_once_unless_its_policy_waits():
    h = Harness("serial")
    h.submit(1, 1)                      # idle: a batch of one at once, never queued
    assert len(h.worker.jobs) == 1 and not h.engine.queues and h.engine.batches_formed == 1
    h.worker.run_next()
    h.worker.run_next()
    np.testing.assert_array_equal(h.y(1), expected(1, 1))

    h = Harness("batch", max_batch=2, batch_window_ms=20)
    h.submit(1, 1)                      # idle too, but the window policy waits for a second request
    assert not h.worker.jobs and h.engine.next_wakeup() == pytest.approx(0.020)
    h.submit(2, 1)
    assert h.worker.jobs[0].inputs["x"].shape == (2, 1)

    h = Harness("serial")
    h.now = 0.010
    h.submit(1, 1, deadline=0.005)      # a deadline goes through the queue, which answers it at once
    assert isinstance(h.answers[1][2], RequestTimeout) and not h.worker.jobs


def test_a_short_stage_runs_on_the_owner_loop_only_when_nothing_else_is_in_flight():
    h = Harness("serial", workers="1,1", inline_run_ms=50)
    for tag in (1, 2):                  # calibrate both stages: 10 ms each, under 50
        h.submit(tag, 1)
        h.worker.run_next()
        h.worker.run_next()
    assert all(not st["inline"] for st in h.answers[2][1]["stages"])
    h.submit(3, 1)                      # idle engine, short stages: answered within submit
    np.testing.assert_array_equal(h.y(3), expected(3, 1))
    assert not h.worker.jobs and [st["inline"] for st in h.answers[3][1]["stages"]] == [True, True]

    h.engine.settings.inline_run_ms = 5  # stages now longer than allowed: handed to a worker thread
    h.submit(4, 1)
    assert 4 not in h.answers and len(h.worker.jobs) == 1
    h.engine.settings.inline_run_ms = 50
    h.submit(5, 1)                      # 4 is in flight: 5 goes to the idle worker, not the loop
    other = h.engine.workers[1]
    assert 5 not in h.answers and len(other.jobs) == 1
    for w in (h.worker, other):         # each one's stage 0 done: the other is still in flight
        w.run_next()
    assert len(h.worker.jobs) + len(other.jobs) == 2
    for w in (h.worker, other):
        w.run_next()
    np.testing.assert_array_equal(h.y(4), expected(4, 1))
    np.testing.assert_array_equal(h.y(5), expected(5, 1))


def test_a_short_stage_on_an_idle_engine_is_answered_within_its_step_with_the_same_records():
    h = Harness("serial", workers="1", inline_run_ms=50)
    for tag in (1, 2):                  # uncalibrated: handed to the worker thread
        h.submit(tag, 1, stages=ONE_STAGE)
        assert tag not in h.answers
        h.worker.run_next()
    h.submit(3, 2, stages=ONE_STAGE)    # batch 2 never measured: not predicted, so not inline
    assert 3 not in h.answers
    h.worker.run_next()
    h.submit(4, 1, stages=ONE_STAGE)    # calibrated at 10 ms, under 50: answered here and now
    outputs, timings, error = h.answers[4]
    assert error is None and not h.worker.jobs and not h.engine.requests
    np.testing.assert_array_equal(outputs["y"], np.array([[400.0]], np.float32) * 2)
    [st] = timings["stages"]
    assert st["inline"] and st["worker"] == 0 and st["predicted_ms"] == pytest.approx(10.0)
    assert timings["total_ms"] == 0.0   # (the fake clock stood still)
    assert h.engine.served == 4 and h.engine.batches_formed == 4
    assert h.engine.perf.summary()["predictions_checked"] == 1

    h.submit(5, 1, stages=ONE_STAGE, x=np.array(["not a number"]))   # a failed run: its error, and on
    assert "stage 0 failed" in str(h.answers[5][2]) and h.engine.failed == 1 and not h.engine.requests
    assert isinstance(h.answers[5][2], RunError)   # not ORT's INVALID_ARGUMENT: not the caller's data
    [(key, stats)] = h.engine.describe()["models"].items()   # per model, for the HTTP statistics extension
    assert (stats["success"], stats["samples"], stats["failed"], stats["executions"]) == (4, 5, 1, 4)   # (request 3 had 2 rows)
    assert stats["rejected"] == 0        # it failed in its run: Triton's failure reason BACKEND, not REJECTED
    assert stats["idle_s"] == 0.0 and stats["run_s"] > 0

    h.engine.settings.batching = "batch"
    h.engine.settings_changed()
    h.submit(6, 1, stages=ONE_STAGE)    # a window policy waits, however short the stage
    assert 6 not in h.answers and h.engine.queues


def test_dynamic_stacks_what_queued_behind_a_running_batch_and_splits_rows_back():
    h = Harness("dynamic", max_batch=4)
    h.submit(1, 1)                      # the worker is idle: runs alone
    h.submit(2, 2)
    h.submit(3, 1)
    h.submit(4, 3)                      # 2 + 1 + 3 > 4: waits, kept whole
    h.worker.run_next()
    h.worker.run_next()
    assert h.worker.jobs[0].inputs["x"].shape == (3, 1)
    for _ in range(4):
        h.worker.run_next()
    for tag, rows in ((1, 1), (2, 2), (3, 1), (4, 3)):
        np.testing.assert_array_equal(h.y(tag), expected(tag, rows))
    assert [st["batch"] for st in h.answers[3][1]["stages"]] == [3, 3]


def test_priority_levels_order_the_batches_and_a_delayed_request_runs_after_its_levels_others():
    """Triton's priority queue: a batch takes level 1 before level 2, each in arrival order; a level-2 request that
    waited past its level's queue timeout with DELAY runs after the level's others, and is not refused."""
    own = {"policy": "dynamic", "max_batch": 2, "priority_levels": 2, "default_priority": 2,
           "priority_queues": {"2": {"queue_timeout_ms": 5.0, "queue_delay": True}}}
    h = Harness("serial", workers="1")
    h.submit(1, 1, serving=own)                 # runs at once
    h.submit(2, 1, serving=own)                 # level 2 (the default), from 0 ms
    h.now = 0.006
    h.engine.on_timer(h.now)                    # 2 waited past 5 ms: delayed, not refused
    assert 2 not in h.answers
    h.submit(3, 1, serving=own, priority=2)     # level 2, within its time: ahead of the delayed 2
    h.submit(4, 1, serving=own, priority=1)     # level 1: ahead of both
    h.submit(5, 1, serving=own, priority=1)
    assert h.engine.describe()["queued_by_model"] == {"m@1": {"1": 2, "2": 2}}
    from modelcache.daemon.metrics import render
    from modelcache.histogram import Histogram
    metrics = render({}, [], [], 0, 1.0, Histogram(), [], executor=h.engine.describe())
    assert 'modelcache_inference_queued{model="m",version="1",level="1"} 2' in metrics
    h.worker.run_next()
    h.worker.run_next()                         # 1 answered; a batch of 2: level 1's, in arrival order
    assert h.worker.jobs[0].inputs["x"][:, 0].tolist() == [400, 500]
    for _ in range(2):
        h.worker.run_next()
    assert h.worker.jobs[0].inputs["x"][:, 0].tolist() == [300, 200]   # then level 2's: 3, then the delayed 2
    for _ in range(2):
        h.worker.run_next()
    for tag in range(1, 6):
        np.testing.assert_array_equal(h.y(tag), expected(tag, 1))
    assert h.engine.describe()["refused"] == {"queue_full": 0, "queue_timeout": 0}


# 10 ms + 1 ms per sample per stage
PROFILE = {"kind": "cpu2", "batches": [1, 8], "stage_s": [[0.011, 0.011], [0.018, 0.018]],
           "ratios": [[0.5, 0.5], [0.5, 0.5]], "g": [0.022, 0.002, 1.0, 1.0], "t_opt_ms": 100.0, "n_opt": 8}


def test_layer_to_layer_catches_up_newcomers_then_runs_them_merged():
    h = Harness("layer")
    h.submit(1, 1, profile=PROFILE)
    h.now = 0.005
    h.submit(2, 2, profile=PROFILE)
    h.submit(3, 1, profile=PROFILE)
    h.now = 0.011
    h.worker.run_next()                 # stage 0 of request 1 done: 2 and 3 are admitted
    assert h.worker.jobs[0].stage == 0 and h.worker.jobs[0].inputs["x"].shape == (3, 1)
    h.worker.run_next()                 # the catch-up reached stage 1: merged, 4 samples
    job = h.worker.jobs[0]
    assert job.stage == 1 and job.inputs["h"].shape == (4, 1)
    h.worker.run_next()
    for tag, rows in ((1, 1), (2, 2), (3, 1)):
        np.testing.assert_array_equal(h.y(tag), expected(tag, rows))
    assert [st["batch"] for st in h.answers[1][1]["stages"]] == [1, 4]
    assert [st["batch"] for st in h.answers[2][1]["stages"]] == [3, 4]
    assert h.engine.describe()["batching"]["layer_joins"] == 2


def test_layer_to_layer_refuses_newcomers_that_would_break_t_opt():
    h = Harness("layer")
    h.submit(1, 1, profile=PROFILE)
    h.now = 0.090                       # request 1 is near its 100 ms bound: a catch-up would break it
    h.submit(2, 1, profile=PROFILE)
    h.worker.run_next()
    assert h.worker.jobs[0].stage == 1 and h.worker.jobs[0].inputs["h"].shape == (1, 1)
    h.worker.run_next()
    h.worker.run_next()
    h.worker.run_next()
    np.testing.assert_array_equal(h.y(2), expected(2, 1))
    assert h.engine.describe()["batching"]["layer_joins"] == 0


def test_a_member_late_after_its_catch_up_is_answered_and_its_rows_leave_the_batch():
    h = Harness("layer", t_opt_ms=1000)
    h.submit(1, 1, profile=PROFILE)
    h.submit(2, 1, deadline=0.040, profile=PROFILE)
    h.now = 0.011
    h.worker.run_next()                 # 2 admitted: predicted to finish at 0.034
    h.now = 0.050
    h.worker.run_next()                 # its catch-up ran slower than predicted: late at the merge
    assert isinstance(h.answers[2][2], RequestTimeout)
    assert h.engine.describe()["models"]["m@1"]["rejected"] == 1   # (its deadline passed: it never ran)
    assert h.worker.jobs[0].inputs["h"].shape == (1, 1)
    h.worker.run_next()
    np.testing.assert_array_equal(h.y(1), expected(1, 1))
    assert not h.engine.requests and not h.engine.batches


def test_a_queued_request_that_cannot_finish_by_its_deadline_is_answered_before_it_runs():
    h = Harness("serial")
    h.submit(1, 1, profile=PROFILE)                # the profile predicts 11 + 11 ms at batch 1
    h.submit(2, 1, deadline=0.030, profile=PROFILE)
    h.submit(3, 1, deadline=0.060, profile=PROFILE)
    h.now = 0.020
    h.worker.run_next()
    h.worker.run_next()                            # at 0.020, 2 would end at 0.042 > 0.030: not started
    assert "cannot be met" in str(h.answers[2][2])
    assert h.worker.jobs[0].inputs["x"][0, 0] == 300


# Batch 1: 11 ms a stage; batch 4: 20 ms a stage (so 22 ms alone, 40 ms as four).
PROFILE_1_4 = {"kind": "cpu2", "batches": [1, 4], "stage_s": [[0.011, 0.011], [0.020, 0.020]],
               "ratios": [[0.5, 0.5], [0.5, 0.5]], "g": [0.022, 0.022, 1.0, 1.0], "t_opt_ms": 1000.0, "n_opt": 4}


def test_a_new_batch_shrinks_until_its_predicted_run_meets_every_deadline():
    h = Harness("dynamic", max_batch=4)
    h.submit(1, 1, profile=PROFILE_1_4)
    for tag in (2, 3, 4, 5):
        h.submit(tag, 1, deadline=0.045, profile=PROFILE_1_4)
    h.now = 0.010
    h.worker.run_next()
    h.worker.run_next()
    # At 0.010 four would end at 0.050 > 0.045, and g (flat: 22 ms a sample) says three or two would too:
    # request 2 runs alone, and the others go back to the queue rather than being dropped.
    assert h.worker.jobs[0].inputs["x"][:, 0].tolist() == [200]
    assert list(h.answers) == [1]
    while h.worker.jobs:
        h.worker.run_next()
    assert all(tag in h.answers for tag in (2, 3, 4, 5))


# The model's copy on device GPU-1234 (what the daemon gives a request once it is there): GPU workers run
# only stages whose weights are on their device.
ON_GPU = {"GPU-1234": [{"uuid": "GPU-1234", "skeleton": "", "tensors": []}]}


class FakeGpuWorker(FakeWorker):
    """As an executor GpuWorker is to a CPU group: its own kind and memory node, nothing else."""

    def __init__(self, worker_id, device, post):
        from modelcache.executor.workers import gpu_kind
        super().__init__(worker_id, [], post)
        self.state = WorkerState(worker_id, kind=gpu_kind(device), memory_node=device.uuid)


def test_gpu_workers_follow_the_cpu_groups_and_dmda_weighs_them_by_calibrated_speed():
    from modelcache.tiers.gpu import GpuDevice
    now = [0.0]
    answers = {}
    engine = Engine(Settings(socket="ipc:///unused", repository="/unused", workers="1", scheduler="dmda",
                             inline_run_ms=0), None, post=lambda fn, r, e: (fn(r, e), engine.step()), clock=lambda: now[0],
                    worker_factory=FakeWorker, gpu_devices=[GpuDevice(0, "GPU-1234", "Fake GPU", 1 << 30)],
                    gpu_worker_factory=FakeGpuWorker)
    cpu, gpu = engine.workers
    assert [w["kind"] for w in engine.describe()["workers"]] == ["cpu1", "gpu:Fake GPU"]
    assert engine.describe()["workers"][1]["device"] == "GPU-1234"
    two = Engine(Settings(socket="ipc:///unused", repository="/unused", workers="1,1"), None, post=None,
                 clock=lambda: 0.0, worker_factory=FakeWorker, gpu_worker_factory=FakeGpuWorker,
                 gpu_devices=[GpuDevice(i, f"GPU-{i}", "Fake GPU", 1 << 30) for i in range(2)])
    assert [(w.state.worker_id, w.state.memory_node) for w in two.workers] == \
        [(0, "cpu"), (1, "cpu"), (2, "GPU-0"), (3, "GPU-1")]   # ids index the engine's worker list

    def submit(tag):
        def finish(outputs, timings, error):
            answers[tag] = (outputs, timings, error)
        engine.submit(ServeRequest("m@1", ONE_STAGE, [], {"x": np.full((1, 1), tag, np.float32)}, None, now[0],
                                   None, finish, samples=1, batchable=True, devices=ON_GPU))
        engine.step()

    for tag, worker, seconds in ((1, cpu, 0.010), (2, cpu, 0.010), (3, gpu, 0.002), (4, gpu, 0.002)):
        submit(tag)                     # dmda explores each kind it has never timed: CPU, then GPU
        assert len(worker.jobs) == 1
        worker.run_next(seconds)
    for tag in range(5, 10):            # all at once: the GPU's queue grows 2 ms (and a copy) a request
        submit(tag)
    assert len(gpu.jobs) == 4 and len(cpu.jobs) == 1   # the 5th would end on the GPU after the CPU's 10 ms
    while gpu.jobs:
        gpu.run_next(0.002)
    cpu.run_next(0.010)
    for tag in range(5, 10):
        outputs, timings, error = answers[tag]
        assert error is None and outputs["y"][0, 0] == 2 * tag
    assert [answers[t][1]["stages"][0]["kind"] for t in range(5, 10)].count("gpu:Fake GPU") == 4


class BrokenGpuWorker(FakeGpuWorker):
    """A GPU worker whose device will not start: every run is a WorkerUnavailable."""

    def run(self, job, seconds: float = 0.01):
        from modelcache.executor.workers import WorkerUnavailable
        job.worker_id = self.state.worker_id
        return WorkerUnavailable("device 0 would not start")


def test_a_worker_that_cannot_start_is_taken_out_and_its_stage_runs_elsewhere():
    from modelcache.tiers.gpu import GpuDevice
    answers = {}
    engine = Engine(Settings(socket="ipc:///unused", repository="/unused", workers="1", scheduler="dmda",
                             inline_run_ms=0), None, post=lambda fn, r, e: (fn(r, e), engine.step()), clock=lambda: 0.0,
                    worker_factory=FakeWorker, gpu_devices=[GpuDevice(0, "GPU-1234", "Fake GPU", 1 << 30)],
                    gpu_worker_factory=BrokenGpuWorker)
    cpu, gpu = engine.workers

    def submit(tag):
        def finish(outputs, timings, error):
            answers[tag] = (outputs, timings, error)
        engine.submit(ServeRequest("m@1", ONE_STAGE, [], {"x": np.full((1, 1), tag, np.float32)}, None, 0.0,
                                   None, finish, samples=1, batchable=True, devices=ON_GPU))
        engine.step()

    for tag in (1, 2):                  # calibrate the CPU group
        submit(tag)
        cpu.run_next()
    submit(3)                           # dmda explores the GPU worker: it fails, and is taken out ...
    assert len(gpu.jobs) == 1
    gpu.run_next()
    assert 3 not in answers and len(cpu.jobs) == 1   # ... and the stage goes to the CPU instead
    cpu.run_next()
    assert answers[3][2] is None and answers[3][0]["y"][0, 0] == 6
    submit(4)                           # never the GPU again
    assert not gpu.jobs and len(cpu.jobs) == 1
    assert engine.describe()["workers"][1]["disabled"] == "device 0 would not start"


class RemembersDrops:
    """A fake worker that remembers drops, to finish them when the test says (a real worker: on its thread, after
    the jobs queued before the drop)."""

    @property
    def drops(self) -> list:
        return self.__dict__.setdefault("_drops", [])

    def drop_model(self, model_key, then=None):
        self.drops.append((model_key, then))


class DroppingGpuWorker(RemembersDrops, FakeGpuWorker):
    pass


def test_the_engine_holds_a_device_copy_while_a_gpu_worker_may_have_sessions():
    """The daemon holds a GPU worker's copy (worker_hold: once per worker, however often the engine asks, as
    the daemon's residency manager does) from its first stage there until the worker dropped its sessions."""
    from modelcache.tiers.gpu import GpuDevice
    held, events, answers = {}, [], {}

    def worker_hold(key, uuid, wid, holds):
        if holds:
            if (key, uuid, wid) not in held:
                held[(key, uuid, wid)] = True
                events.append(("hold", key, uuid))
            return None
        return (lambda: events.append(("end", key, uuid))) if held.pop((key, uuid, wid), None) else None

    engine = Engine(Settings(socket="ipc:///unused", repository="/unused", workers="1", scheduler="dmda",
                             inline_run_ms=0), None, post=lambda fn, r, e: (fn(r, e), engine.step()), clock=lambda: 0.0,
                    worker_factory=FakeWorker, gpu_devices=[GpuDevice(0, "GPU-1234", "Fake GPU", 1 << 30)],
                    gpu_worker_factory=DroppingGpuWorker, worker_hold=worker_hold)
    cpu, gpu = engine.workers

    def submit(tag, devices=ON_GPU, stages=ONE_STAGE):
        def finish(outputs, timings, error):
            answers[tag] = (outputs, timings, error)
        engine.submit(ServeRequest("m@1", stages, [], {"x": np.full((1, 1), tag, np.float32)}, None, 0.0,
                                   None, finish, samples=1, batchable=True, devices=devices))
        engine.step()

    for tag in (1, 2):                  # calibrate the CPU group: no hold
        submit(tag)
        cpu.run_next()
    assert events == []
    submit(3)                           # explored on the GPU: the copy there is held for the worker
    job = gpu.run_next()
    assert job.device == ON_GPU["GPU-1234"][0] and not job.keep_on_device
    assert events == [("hold", "m@1", "GPU-1234")]
    submit(4)
    gpu.run_next() if gpu.jobs else cpu.run_next()
    assert events == [("hold", "m@1", "GPU-1234")]   # one per (worker, model), however many stages run there
    submit(5, devices={})               # a request whose model is not on the device: CPU only
    assert not gpu.jobs and len(cpu.jobs) == 1
    cpu.run_next()

    engine.drop_model("m@1")            # eviction: the hold ends once the worker dropped its sessions
    [(key, then)] = gpu.drops
    assert key == "m@1" and events == [("hold", "m@1", "GPU-1234")]
    submit(6)                           # placed there meanwhile: a new hold, its own
    on_gpu = bool(gpu.jobs)
    while gpu.jobs or cpu.jobs:
        (gpu if gpu.jobs else cpu).run_next()
    then()
    assert events[-1] == ("end", "m@1", "GPU-1234")
    assert events.count(("hold", "m@1", "GPU-1234")) == 1 + on_gpu
    assert all(answers[t][2] is None for t in range(1, 7))


def test_two_stage_requests_keep_the_crossing_tensor_on_the_gpu_that_made_it():
    from modelcache.tiers.gpu import GpuDevice
    engine = Engine(Settings(socket="ipc:///unused", repository="/unused", workers="1", scheduler="dmda",
                             inline_run_ms=0), None, post=lambda fn, r, e: (fn(r, e), engine.step()), clock=lambda: 0.0,
                    worker_factory=FakeWorker, gpu_devices=[GpuDevice(0, "GPU-1234", "Fake GPU", 1 << 30)],
                    gpu_worker_factory=FakeGpuWorker)
    cpu, gpu = engine.workers
    spec = {"uuid": "GPU-1234", "skeleton": "", "tensors": []}
    answers = {}
    engine.submit(ServeRequest("m@1", STAGES, [], {"x": np.ones((1, 1), np.float32)}, None, 0.0, None,
                               lambda o, t, e: answers.setdefault(1, (o, e)), samples=1, batchable=True,
                               devices={"GPU-1234": [spec, spec]}))
    engine.step()
    worker = gpu if gpu.jobs else cpu
    job = worker.jobs[0]
    assert job.keep_on_device == (worker is gpu)   # a later stage reads it: a GPU worker leaves it there
    worker.run_next()
    (gpu if gpu.jobs else cpu).run_next()
    assert answers[1][1] is None and answers[1][0]["y"][0, 0] == 4


def test_the_mean_batch_counts_requests_not_their_samples():
    """`status` said "mean 3.58" under serial, where every batch is one request: it divided samples."""
    h = Harness("serial")
    for tag, rows in enumerate((3, 5, 1, 4), 1):   # multi-sample requests, one per batch
        h.submit(tag, rows)
    while h.worker.jobs:
        h.worker.run_next()
    batching = h.engine.describe()["batching"]
    assert batching["batches"] == 4 and batching["mean_batch"] == 1.0 and batching["mean_batch_samples"] == 13 / 4


class DroppingWorker(RemembersDrops, FakeWorker):
    pass


def test_a_drop_is_reported_once_every_worker_has_dropped_the_models_sessions():
    """The daemon's memory limit waits for a model's sessions to be gone (daemon/serving.py): drop_model's `then`
    runs on the owner loop once, after the last worker's drop, not before."""
    posted, done = [], []
    engine = Engine(Settings(socket="ipc:///unused", repository="/unused", workers="1,1", scheduler="eager"), None,
                    post=lambda fn, r, e: posted.append((fn, r, e)), clock=lambda: 0.0,
                    worker_factory=DroppingWorker)
    engine.drop_model("m@1", then=lambda: done.append("m@1"))
    first, second = engine.workers
    [(key, then_first)], [(_, then_second)] = first.drops, second.drops
    assert key == "m@1"
    then_first()                          # on the worker's thread: posted to the owner loop
    for fn, r, e in posted:
        fn(r, e)
    assert done == []                     # the other worker still has the sessions
    posted.clear()
    then_second()
    for fn, r, e in posted:
        fn(r, e)
    assert done == ["m@1"]
