"""The placement simulator on hand-built cost tables: queues, link contention, dmda within a set."""

import numpy as np
import pytest

from modelcache.placement.costs import CostTable
from modelcache.placement.plan import Plan, PlanCost, Stage
from modelcache.placement.simulate import poisson_arrivals, simulate
from modelcache.placement.system import parse_system

SYSTEM = parse_system({
    "name": "two devices",
    "kinds": {k: {"conv_gflop_s": 1, "matmul_gflop_s": 1, "other_gflop_s": 1, "mem_gbyte_s": 1}
              for k in ("cpu1", "dev")},
    "workers": [{"name": "c0", "kind": "cpu1"}, {"name": "c1", "kind": "cpu1"},
                {"name": "d0", "kind": "dev", "memory_node": "d0"}],
    "links": [{"nodes": ["host", "d0"], "gbit_per_s": 8, "latency_us": 0}],     # 1 GB/s
}, "test")


def table(batch=2):
    # Two nodes; per sample: cpu1 10 ms + 20 ms, dev 1 ms + 2 ms; 1 MB crosses each boundary per sample.
    per = {"cpu1": [0.010, 0.020], "dev": [0.001, 0.002]}
    node_s = {k: np.outer(np.arange(batch + 1), v) for k, v in per.items()}
    return CostTable.from_node_seconds("t", node_s, [1e6, 1e6, 1e6])


def test_one_request_takes_the_analytical_latency():
    cost = PlanCost(table(1), SYSTEM, 1)
    plan = Plan([Stage(0, 1, (2,), (1,)), Stage(1, 2, (0,), (1,))], 1)
    [lat] = simulate(cost, plan, [0.0]).latencies_s
    # 1 MB to d0 (1 ms), 1 ms there, 1 MB back (1 ms), 20 ms on c0
    assert lat == pytest.approx(cost.latency_s(plan)) and lat == pytest.approx(0.023)


def test_a_split_stage_is_no_slower_than_the_analytical_bound():
    cost = PlanCost(table(2), SYSTEM, 2)
    plan = Plan([Stage(0, 2, (0, 2), (1, 1))], 2)
    [lat] = simulate(cost, plan, [0.0]).latencies_s
    assert lat <= cost.latency_s(plan) + 1e-12
    assert lat == pytest.approx(0.031)    # c0 runs its row in 30 ms (d0 its own in 1+3 ms); then d0's row goes back (1 ms)


def test_requests_queue_on_a_busy_worker():
    cost = PlanCost(table(1), SYSTEM, 1)
    plan = Plan([Stage(0, 2, (0,), (1,))], 1)
    result = simulate(cost, plan, [0.0, 0.0, 0.005])
    assert result.latencies_s == pytest.approx([0.030, 0.060, 0.085])


def test_messages_queue_on_a_shared_link():
    cost = PlanCost(table(1), SYSTEM, 1)
    plan = Plan([Stage(0, 2, (2,), (1,))], 1)
    result = simulate(cost, plan, [0.0, 0.0])
    # each: 1 ms in, 3 ms on d0, 1 ms out; the second's input waits 1 ms for the link, then d0 is busy until 4 ms
    assert result.latencies_s == pytest.approx([0.005, 0.008])
    links = [i for i in result.intervals if i.resource == "link host->d0"]
    assert [x for i in links for x in (i.start, i.end)] == pytest.approx([0, 0.001, 0.001, 0.002])


def test_dmda_spreads_requests_over_a_set():
    cost = PlanCost(table(1), SYSTEM, 1)
    plan = Plan([Stage(0, 2, (0, 1), (1, 0))], 1)
    result = simulate(cost, plan, [0.0, 0.0], within_set="dmda")
    assert result.latencies_s == pytest.approx([0.030, 0.030])
    assert {i.resource for i in result.intervals} == {"c0", "c1"}
    split = simulate(cost, plan, [0.0, 0.0], within_set="split")   # the plan's split: all on c0
    assert split.latencies_s == pytest.approx([0.030, 0.060])


def test_a_pipeline_under_heavy_load_runs_at_its_bottleneck():
    cost = PlanCost(table(1), SYSTEM, 1)
    plan = Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (1,), (1,))], 1)    # 10 ms then 20 ms: 50 req/s at most
    arrivals = poisson_arrivals(200.0, 400, seed=1)
    result = simulate(cost, plan, arrivals, record=False)
    assert result.completed == 400
    assert result.throughput_per_s(arrivals) == pytest.approx(1 / cost.bottleneck_s(plan), rel=0.02)
    light = poisson_arrivals(5.0, 200, seed=1)
    quiet = simulate(cost, plan, light, record=False)
    assert quiet.percentile_s(0.5) == pytest.approx(0.030, rel=0.01)
    assert quiet.percentile_s(0.99) >= quiet.percentile_s(0.5)


def test_poisson_arrivals_are_seeded():
    assert poisson_arrivals(10, 5, seed=3) == poisson_arrivals(10, 5, seed=3)
    assert np.mean(np.diff(poisson_arrivals(10, 5000, seed=3))) == pytest.approx(0.1, rel=0.05)


def test_serving_overheads_delay_stages_but_hold_no_worker():
    # 0.5 ms per stage hand-off, 2 ms per request: one request pays both; under load the worker
    # runs back to back, since a hand-off is the daemon's queue and wake-up, not the worker's time.
    import dataclasses
    system = dataclasses.replace(SYSTEM, handoff_s=0.0005, request_s=0.002)
    cost = PlanCost(table(1), system, 1)
    plan = Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (1,), (1,))], 1)
    [lat] = simulate(cost, plan, [0.0]).latencies_s
    assert lat == pytest.approx(0.010 + 0.020 + 2 * 0.0005 + 0.002) and lat == pytest.approx(cost.latency_s(plan))
    result = simulate(cost, plan, [0.0] * 20, within_set="dmda", samples=1)
    c1 = sorted((i.start, i.end) for i in result.intervals if i.resource == "c1")
    assert all(b[0] == pytest.approx(a[1]) for a, b in zip(c1[1:], c1[2:]))   # c1 (the bottleneck) never idles


def test_serving_overheads_round_trip_through_toml():
    from modelcache.placement.system import format_system
    import tomllib
    data = tomllib.loads(format_system(SYSTEM).replace("request_us = 0.0", "request_us = 2000.0")
                         .replace("handoff_us = 0.0", "handoff_us = 450.0"))
    system = parse_system(data, "t")
    assert (system.request_s, system.handoff_s) == pytest.approx((0.002, 0.00045))
    assert parse_system(tomllib.loads(format_system(system)), "t") == system
    with pytest.raises(Exception, match="handoff_us"):
        parse_system({**data, "handoff_us": -1}, "t")


def test_dmda_admits_a_request_only_when_a_worker_is_idle():
    # As the daemon's engine: both stages on c0, three requests at once. Each waits until c0 has
    # nothing assigned, so the hand-offs (1 ms) leave c0 idle: 2 stages x (1 + 10/20 ms) a request.
    import dataclasses
    system = dataclasses.replace(parse_system({**{k: v for k, v in {
        "name": "one", "kinds": {"cpu1": {"conv_gflop_s": 1, "matmul_gflop_s": 1, "other_gflop_s": 1,
                                          "mem_gbyte_s": 1}}}.items()}, "workers": [{"name": "c0", "kind": "cpu1"}]},
        "t"), handoff_s=0.001)
    cost = PlanCost(table(1), system, 1)
    plan = Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (0,), (1,))], 1)
    result = simulate(cost, plan, [0.0, 0.0, 0.0], within_set="dmda", samples=1)
    assert result.finished_at == pytest.approx([0.032, 0.064, 0.096])
    # the plan's split mode starts every arrival at once: c0 runs the first stages back to back
    split = simulate(cost, plan, [0.0, 0.0, 0.0], within_set="split")
    assert max(split.finished_at) == pytest.approx(0.091)


def test_serving_work_on_the_workers_cores_takes_an_idle_worker_else_stretches_one():
    import dataclasses
    base = dataclasses.replace(SYSTEM, request_s=0.004)
    shared = dataclasses.replace(base, serving_on_worker_cores=True)
    plan = Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (1,), (1,))], 1)     # 10 ms on c0, 20 ms on c1
    for system in (base, shared):     # one request: 4 ms either way
        cost = PlanCost(table(1), system, 1)
        assert simulate(cost, plan, [0.0]).latencies_s == pytest.approx([0.034])
    # One host worker (as group "2"): nowhere else to run, so every request's 4 ms is that worker's time.
    one = dataclasses.replace(shared, workers=shared.workers[:1])
    cost = PlanCost(table(1), one, 1)
    plan0 = Plan([Stage(0, 2, (0,), (1,))], 1)                                # 30 ms on c0, + 4 ms a request
    assert cost.bottleneck_s(plan0) == pytest.approx(0.034)
    assert PlanCost(table(1), dataclasses.replace(base, workers=base.workers[:1]), 1).bottleneck_s(plan0) == \
        pytest.approx(0.030)
    result = simulate(cost, plan0, [0.0] * 10, within_set="dmda", samples=1)
    assert max(result.finished_at) == pytest.approx(10 * 0.034)
    # Two host workers, all stages on c0: c1 is idle, the serving work runs there and c0 never waits for it.
    cost = PlanCost(table(1), shared, 1)
    assert cost.bottleneck_s(plan0) == pytest.approx(0.030)
    arrivals = [i * 0.030 for i in range(10)]           # each after c0 started the one before
    result = simulate(cost, plan0, arrivals, within_set="dmda", samples=1)
    assert max(result.finished_at) == pytest.approx(0.004 + 10 * 0.030)
    assert [i.resource for i in result.intervals if i.stage == -1] == ["c0"] + ["c1"] * 9   # the first: both idle
    # Both busy at every arrival: the work stretches the running stage of the worker with fewer assigned.
    result = simulate(cost, plan, [0.0, 0.001], within_set="split", samples=1)
    # r0: served on c0 (both idle, fewest assigned, lowest index) 0-4, then c0 4-14, c1 14-34 ms;
    # r1 arrives at 1 ms, c0 busy serving r0 and c1 idle: served on c1 1-5, c0 14-24, c1 34-54
    assert result.finished_at == pytest.approx([0.034, 0.054])
    result = simulate(cost, plan, [0.0, 0.0, 0.002], within_set="split", samples=1)
    # r2 at 2 ms finds c0 and c1 serving r0 and r1: it stretches c0's (lowest index; neither has a stage)
    stretched = [i for i in result.intervals if i.resource == "c0" and i.stage == -1]
    assert [x for i in stretched for x in (i.start, i.end)] == pytest.approx([0.0, 0.008])


def test_the_bound_counts_serving_work_against_the_host_workers_slack():
    import dataclasses
    shared = dataclasses.replace(SYSTEM, request_s=0.004, serving_on_worker_cores=True)
    cost = PlanCost(table(1), shared, 1)
    # 10 ms on c0, 20 ms on c1: 10 ms of slack on c0 absorbs the 4 ms
    assert cost.bottleneck_s(Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (1,), (1,))], 1)) == pytest.approx(0.020)
    # 30 ms split 10 + 20 over c0 and c1 of a batch of 2... one request per batch here: both 15 ms a row
    per = {"cpu1": [0.015, 0.015], "dev": [0.001, 0.001]}
    node_s = {k: np.outer(np.arange(2), v) for k, v in per.items()}
    even = PlanCost(CostTable.from_node_seconds("t", node_s, [1e6, 1e6, 1e6]), shared, 1)
    plan = Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (1,), (1,))], 1)
    assert even.bottleneck_s(plan) == pytest.approx((0.030 + 0.004) / 2)
    arrivals = [i * 0.010 for i in range(400)]                     # offered faster than either bound
    rate = simulate(even, plan, arrivals, within_set="dmda", samples=1, record=False).throughput_per_s(arrivals)
    assert 1 / 0.0191 <= rate <= 1 / 0.017                         # between stretching one always and the bound


def test_a_stage_on_a_worker_that_idled_pays_its_kinds_wake_up():
    """CostTable.wake_s: a worker idle WAKE_AFTER_S or more before a stage runs it that much longer; one that
    just finished the previous request's stage does not."""
    from modelcache.placement.profile import WAKE_AFTER_S
    t = table(1)
    t.wake_s = {"cpu1": 0.002}
    cost = PlanCost(t, SYSTEM, 1)
    plan = Plan([Stage(0, 2, (0,), (1,))], 1)          # both nodes on c0: 30 ms a request
    cold = simulate(cost, plan, [0.0], within_set="dmda").latencies_s[0]
    assert cold == pytest.approx(0.032)
    # The second arrives while the first runs: it starts the moment c0 frees, warm.
    back_to_back = simulate(cost, plan, [0.0, 0.001], within_set="dmda").finished_at
    assert back_to_back[1] - back_to_back[0] == pytest.approx(0.030)
    # One that arrives after c0 idled longer than WAKE_AFTER_S pays it again.
    later = 0.032 + 2 * WAKE_AFTER_S
    spaced = simulate(cost, plan, [0.0, later], within_set="dmda").latencies_s
    assert spaced == pytest.approx([0.032, 0.032])
    t.wake_s = {}
    assert simulate(cost, plan, [0.0], within_set="dmda").latencies_s[0] == pytest.approx(0.030)


def test_requests_sent_one_at_a_time_find_a_busy_worker_warm():
    """one_at_a_time: each request arrives as the previous is answered; only the first pays the wake-up
    of a worker that runs every stage, while a worker idle through another's stage pays it every time."""
    from modelcache.placement.simulate import one_at_a_time
    t = table(1)
    t.wake_s = {"cpu1": 0.002}
    cost = PlanCost(t, SYSTEM, 1)
    one_worker = Plan([Stage(0, 2, (0,), (1,))], 1)
    assert one_at_a_time(cost, one_worker, 3) == pytest.approx([0.032, 0.030, 0.030])
    # c0 idles through c1's 20 ms stage (over WAKE_AFTER_S), c1 only through c0's 12 ms (under it)
    two = Plan([Stage(0, 1, (0,), (1,)), Stage(1, 2, (1,), (1,))], 1)
    lat = one_at_a_time(cost, two, 3)
    assert lat[0] == pytest.approx(0.034) and lat[1] == pytest.approx(0.032)
