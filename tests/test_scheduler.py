"""Scheduler policies with hand-built workers and predictions: exact placements expected."""

import pytest

from modelcache.executor.scheduler import DMDA, Eager, RoundRobin, Task, TransferModel, WorkerState, make_scheduler

# Two CPU groups: "cpu2" (2 threads) runs every stage in half the time of "cpu1".
TIMES = {("m", 0, "cpu2"): 0.010, ("m", 1, "cpu2"): 0.010, ("m", 0, "cpu1"): 0.020, ("m", 1, "cpu1"): 0.020}


def predict(model, stage, kind, batch):
    t = TIMES.get((model, stage, kind))
    return None if t is None else t * batch


def workers(fast_free_at=0.0, slow_free_at=0.0):
    return [WorkerState(0, "cpu2", free_at=fast_free_at), WorkerState(1, "cpu1", free_at=slow_free_at)]


def test_dmda_prefers_the_fast_worker_when_both_are_free():
    [p] = DMDA().place([Task(1, "m", 0)], workers(), now=0.0, predict=predict)
    assert (p.worker_id, p.start, p.end) == (0, 0.0, 0.010)


def test_dmda_sends_the_second_stage_to_the_slower_worker_when_the_fast_one_is_busy():
    # The fast group is busy for 25 ms more; finishing on the slow one (20 ms) is earlier than 25 + 10.
    [p] = DMDA().place([Task(1, "m", 1)], workers(fast_free_at=0.025), now=0.0, predict=predict)
    assert (p.worker_id, p.end) == (1, pytest.approx(0.020))


def test_dmda_waits_for_the_fast_worker_when_that_finishes_sooner():
    [p] = DMDA().place([Task(1, "m", 1)], workers(fast_free_at=0.005), now=0.0, predict=predict)
    assert (p.worker_id, p.start, p.end) == (0, 0.005, pytest.approx(0.015))


def test_dmda_fills_queues_as_it_places_a_burst():
    w = workers()
    placed = DMDA().place([Task(i, "m", 0) for i in range(4)], w, now=0.0, predict=predict)
    # fast: 0-10, 10-20; slow: 0-20 (ends at 20 == fast's 20? fast wins ties -> 20-30); then slow.
    assert [(p.worker_id, round(p.end, 3)) for p in placed] == [(0, 0.01), (0, 0.02), (1, 0.02), (0, 0.03)]
    assert w[0].free_at == pytest.approx(0.03) and w[1].free_at == pytest.approx(0.02)


def test_dmda_counts_transfers_to_another_memory_node():
    w = [WorkerState(0, "gpu", memory_node="gpu-uuid-1"), WorkerState(1, "cpu1")]
    times = {("m", 0, "gpu"): 0.001, ("m", 0, "cpu1"): 0.020}
    pred = lambda m, s, k, b: times[(m, s, k)]  # noqa: E731
    slow_link = TransferModel(bandwidth_bytes_s=1e9, latency_s=0.0)
    # 40 MB over 1 GB/s = 40 ms of copy: the CPU's 20 ms wins.
    [p] = DMDA().place([Task(1, "m", 0, input_bytes=40_000_000)], w, 0.0, pred, slow_link)
    assert p.worker_id == 1
    [p] = DMDA().place([Task(2, "m", 0, input_bytes=1_000_000)], w, 0.0, pred, slow_link)
    assert p.worker_id == 0 and p.start == pytest.approx(0.001)


def test_dmda_explores_uncalibrated_workers_first():
    [p] = DMDA().place([Task(1, "new-model", 0)], workers(), 0.0, predict)
    assert p.worker_id == 0 and p.predicted_s is None
    w = workers()
    times = {("m2", 0, "cpu2"): 0.01}                     # cpu1 never measured for m2
    [p] = DMDA().place([Task(1, "m2", 0)], w, 0.0, lambda m, s, k, b: times.get((m, s, k)))
    assert p.worker_id == 1


def test_eager_takes_the_first_free_worker_regardless_of_speed():
    [p] = Eager().place([Task(1, "m", 0)], workers(fast_free_at=0.001), now=0.0, predict=predict)
    assert p.worker_id == 1                                # slow but idle
    [a, b] = Eager().place([Task(1, "m", 0), Task(2, "m", 0)], workers(), 0.0, predict)
    assert (a.worker_id, b.worker_id) == (0, 1)


def test_round_robin_cycles():
    rr = RoundRobin()
    placed = rr.place([Task(i, "m", 0) for i in range(5)], workers(), 0.0, predict)
    assert [p.worker_id for p in placed] == [0, 1, 0, 1, 0]


def test_make_scheduler():
    assert make_scheduler("dmda").name == "dmda"
    with pytest.raises(ValueError, match="eager, round-robin, dmda"):
        make_scheduler("random")


def test_perf_models_calibrate_predict_and_persist(tmp_path):
    from modelcache.executor.perfmodel import PerfModels
    pm = PerfModels()
    assert pm.predict("m", 0, "cpu1") is None
    pm.record("m", 0, "cpu1", 1, 0.010)
    assert pm.predict("m", 0, "cpu1") is None            # one sample is not a calibration
    pm.record("m", 0, "cpu1", 1, 0.012)
    pm.record("m", 0, "cpu1", 1, 0.500)                   # a preempted run barely moves the median
    assert pm.predict("m", 0, "cpu1") == 0.012
    pm.record("m", 0, "cpu1", 1, 0.010, predicted=0.012)  # 20 % off
    pm.record("m", 0, "cpu1", 1, 0.012, predicted=0.012)  # exact
    assert pm.median_error() == pytest.approx(0.1)
    pm.save(tmp_path / "perf.json")
    again = PerfModels.load(tmp_path / "perf.json")
    assert again.predict("m", 0, "cpu1") == pm.predict("m", 0, "cpu1")
    assert PerfModels.load(tmp_path / "missing.json").predict("m", 0, "cpu1") is None
    pm.record("alexnet@2", 1, "cpu2", 4, 0.020)          # names with digits and '@' round-trip too
    pm.record("alexnet@2", 1, "cpu2", 4, 0.020)
    pm.save(tmp_path / "perf.json")
    assert PerfModels.load(tmp_path / "perf.json").predict("alexnet@2", 1, "cpu2", 4) == 0.020
    (tmp_path / "bad.json").write_text('{"no separators": [1.0]}')
    assert PerfModels.load(tmp_path / "bad.json").summary()["keys"] == 0   # damaged: starts uncalibrated
