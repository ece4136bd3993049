"""Profiling a model on the daemon's own CPU workers (Client.profile, `place --profile-on`): a real daemon,
real ORT profiles over the host tier's weights, and bad requests refused with the daemon still serving."""

import math

import numpy as np
import onnx
import pytest

from modelcache.errors import InputError, ModelNotFound
from modelcache.executor.profile import profiling_options, run_profiled
from modelcache.placement.profile import PooledProfile, daemon_source
from modelcache.zoo import sample_inputs

from conftest import DaemonProcess, stop_cleanly


@pytest.fixture
def two_workers(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1,1", "MODELCACHE_GPUS": "none"}).start()
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-vit"), "tv")
            yield d, c, sample_inputs(zoo_file("tiny-vit"), batch=1)
        stop_cleanly(d)
    finally:
        d.kill()


def skeleton_nodes(d) -> set:
    model = onnx.load(str(d.repository / "tv" / "1" / "model.onnx"), load_external_data=False)
    return {n.name for n in model.graph.node}


def test_a_profile_on_a_named_worker_times_every_node_of_the_packed_model(two_workers):
    d, c, feeds = two_workers
    reply = c.profile("tv", feeds, worker="cpu-1", runs=3, min_s=0)
    assert (reply.worker, reply.threads, reply.name, reply.version) == ("cpu-1", 1, "tv", 1)
    assert reply.times and set(reply.times) <= skeleton_nodes(d)
    # one warm-up and the 3 back-to-back runs; the cold runs between them give the wake-up samples
    assert {len(t) for t in reply.times.values()} == {4}
    assert len(reply.wake_s) == 2 and all(math.isfinite(w) for w in reply.wake_s)
    assert all(t > 0 for ts in reply.times.values() for t in ts)
    assert all("op_name" in a and "thread_scheduling_stats" not in a for a in reply.args.values())
    assert c.profile("tv", feeds).worker == "cpu-0"            # none named: the first CPU worker
    outputs, _ = c.infer("tv", feeds)                          # serving goes on, with the same weights
    assert all(np.isfinite(v).all() for v in outputs.values())


def test_bad_profile_requests_are_refused_and_the_daemon_serves_on(two_workers):
    d, c, feeds = two_workers
    with pytest.raises(InputError, match="no CPU worker 'cpu-7'.*cpu-0, cpu-1"):
        c.profile("tv", feeds, worker="cpu-7")
    for runs, min_s in ((0, 1.0), (101, 1.0), (3, -1.0), (3, float("nan")), (3, 1e9)):
        with pytest.raises(InputError, match="runs"):
            c.profile("tv", feeds, runs=runs, min_s=min_s)
    with pytest.raises(InputError, match="unknown input"):
        c.profile("tv", {"nope": np.zeros((1, 3), np.float32)})
    with pytest.raises(ModelNotFound):
        c.profile("missing", feeds)
    assert c.profile("tv", feeds, runs=1, min_s=0).times     # still up, still profiling
    assert c.stats().executor["workers"][0]["queued"] == 0   # every profile gave its worker back


def test_a_pooled_profile_from_the_daemon_summarizes_like_one_taken_here(two_workers):
    d, c, feeds = two_workers
    skeleton = d.repository / "tv" / "1" / "model.onnx"
    there = PooledProfile(skeleton, feeds, [1], source=daemon_source(c, "tv", feeds))
    here = PooledProfile(skeleton, feeds, [1])
    for pool in (there, here):
        pool.take(runs=3, min_s=0)
        pool.take(runs=3, min_s=0)
    assert set(there.summary()[1]) == set(here.summary()[1])
    assert all(len(t) == 6 for t in there.times[1].values())     # two profiles, warm-ups left out
    assert there.wake_s()[1] >= 0 and len(there.wake[1]) == 4
    with pytest.raises(ValueError, match="no CPU worker of 2 threads.*cpu-0 \\(1 threads\\)"):
        PooledProfile(skeleton, feeds, [2], source=daemon_source(c, "tv", feeds)).take(runs=1, min_s=0)


def test_run_profiled_alternates_back_to_back_and_cold_runs(zoo_file, tmp_path):
    import onnxruntime as ort
    path = zoo_file("tiny-vit")
    so = profiling_options(1, str(tmp_path))
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    times, args, wake = run_profiled(sess, sample_inputs(path, batch=1), runs=5, min_s=0)
    assert {len(t) for t in times.values()} == {6} and len(wake) == 4
    assert set(times) == set(args)


def test_place_profiles_on_the_daemons_workers_and_says_so(two_workers, tmp_path, capsys):
    from modelcache.cli import main
    d, c, _ = two_workers
    system = tmp_path / "here.toml"
    assert main(["place", "--describe", "--workers", "1,1", "-o", str(system)]) == 0
    common = ["--repository", str(d.repository), "--socket", d.socket, "--system", str(system), "--time-budget", "3"]
    assert main(["place", "tv", *common, "--profile-on", "daemon", "-o", str(tmp_path / "a.json")]) == 0
    assert "measured (ORT profiler, the daemon's worker cpu-0)" in capsys.readouterr().out
    assert main(["place", "tv", *common, "--profile-on", "here", "-o", str(tmp_path / "b.json")]) == 0
    assert "measured (ORT profiler, this process" in capsys.readouterr().out
    gone = ["--repository", str(d.repository), "--socket", f"ipc://{tmp_path}/nobody.sock", "--system", str(system),
            "--time-budget", "3"]
    assert main(["place", "tv", *gone, "-o", str(tmp_path / "c.json")]) == 0     # auto: falls back, says why
    assert "profiling in this process, not on the daemon's workers" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="cannot profile on the daemon's workers"):
        main(["place", "tv", *gone, "--profile-on", "daemon", "-o", str(tmp_path / "d.json")])


def test_a_profile_or_request_of_a_model_the_tier_cannot_hold_is_refused_and_holds_nothing(tmp_path, zoo_file):
    """No room to load the model: the error is the answer, and the model is not left "in use"."""
    from modelcache.errors import CapacityError
    # (1M: a tier far below the model's size; squeezenet1_1's 4.7 MiB of weights do not fit)
    d = DaemonProcess(tmp_path, {"MODELCACHE_WORKERS": "1", "MODELCACHE_HOST_CAPACITY": "1M"}).start()
    try:
        with d.client() as c:
            c.add(zoo_file("squeezenet1_1"), "tv")
            feeds = sample_inputs(zoo_file("squeezenet1_1"), batch=1)
            with pytest.raises(CapacityError, match="raise host_capacity"):
                c.profile("tv", feeds, min_s=0)
            with pytest.raises(CapacityError, match="raise host_capacity"):
                c.infer("tv", feeds)
            c.remove("tv", 1)                   # refused while anything held it
            assert c.list() == []
        stop_cleanly(d)
    finally:
        d.kill()


def test_kernel_events_go_to_the_run_they_started_in():
    """A node with two kernels a run is summed there, one a run skipped is 0 there: run i is run i for all."""
    from modelcache.executor.profile import node_events
    run = lambda ts: {"cat": "Session", "name": "model_run", "ts": ts, "dur": 90}          # noqa: E731
    kern = lambda n, ts, dur: {"cat": "Node", "name": f"{n}_kernel_time", "ts": ts, "dur": dur,  # noqa: E731
                               "args": {"op_name": "Op", "thread_scheduling_stats": {"x": 1}}}
    events = [run(0), kern("a", 1, 10), kern("a", 5, 10), kern("b", 20, 5), run(100), kern("a", 101, 30)]
    times, args = node_events(events, 2)
    assert times == {"a": [pytest.approx(20e-6), pytest.approx(30e-6)], "b": [pytest.approx(5e-6), 0.0]}
    assert args["a"] == {"op_name": "Op"}
    unaligned, _ = node_events(events, 3)    # the runs cannot be told apart: as the events come
    assert unaligned == {"a": pytest.approx([10e-6, 10e-6, 30e-6]), "b": pytest.approx([5e-6])}


def test_the_wake_up_needs_samples_and_is_at_most_a_tenth_of_a_run(tmp_path):
    skeleton = tmp_path / "m.onnx"
    pool = PooledProfile(skeleton, {}, [1], source=lambda *a: ({"a": [0.0, 0.010, 0.010]}, {"a": {}}, [0.002, 0.004]))
    pool.take()
    assert pool.wake_s() == {1: 0.0}                 # 2 cold runs: too few to tell
    pool.take()
    assert pool.wake_s() == {1: pytest.approx(0.001)}   # median 3 ms, capped at 10 % of the 10 ms run


def test_a_profile_stops_starting_runs_past_its_time_or_when_told(zoo_file, tmp_path):
    import onnxruntime as ort
    path = zoo_file("tiny-vit")
    feeds = sample_inputs(path, batch=1)
    sess = ort.InferenceSession(path, profiling_options(1, str(tmp_path)), providers=["CPUExecutionProvider"])
    times, _, _ = run_profiled(sess, feeds, runs=100, min_s=0, max_s=0.0)
    assert {len(t) for t in times.values()} == {2}        # the warm-up and one run: then the time was up
    sess = ort.InferenceSession(path, profiling_options(1, str(tmp_path)), providers=["CPUExecutionProvider"])
    times, _, _ = run_profiled(sess, feeds, runs=100, min_s=0, should_stop=lambda: True)
    assert {len(t) for t in times.values()} == {2}
