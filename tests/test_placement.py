"""Placement search: system descriptions, cost tables, the DP, the GA and the baselines, on hand-built inputs."""

import math
import random

import numpy as np
import pytest

from modelcache.placement.baselines import fastest_single, greedy_by_speed, half_split, tail_fraction
from modelcache.placement.costs import CostTable, build_table, roofline_s
from modelcache.placement.dp import optimal_latency_plan
from modelcache.placement.ga import GeneticSearch, runs_of
from modelcache.placement.plan import Plan, PlanCost, Stage, rows_moved
from modelcache.placement.profile import NodeFacts, flops_of
from modelcache.placement.search import place
from modelcache.placement.split import SplitSearch
from modelcache.placement.system import SystemDescriptionError, format_system, parse_system

TWO_GPU = {
    "name": "cpu + two gpus",
    "kinds": {"cpu2": {"conv_gflop_s": 50, "matmul_gflop_s": 50, "other_gflop_s": 10, "mem_gbyte_s": 10},
              "big": {"conv_gflop_s": 5000, "matmul_gflop_s": 5000, "other_gflop_s": 500, "mem_gbyte_s": 500,
                      "launch_us": 10},
              "small": {"conv_gflop_s": 1000, "matmul_gflop_s": 1000, "other_gflop_s": 100, "mem_gbyte_s": 200}},
    "workers": [{"name": "cpu", "kind": "cpu2"},
                {"name": "g0", "kind": "big", "memory_node": "g0", "memory_gbyte": 16},
                {"name": "g1", "kind": "small", "memory_node": "g1", "memory_gbyte": 8}],
    "links": [{"nodes": ["host", "g0"], "gbit_per_s": 128, "latency_us": 10},
              {"nodes": ["host", "g1"], "gbit_per_s": 64, "latency_us": 10}],
}


def system_of(data=None):
    return parse_system(data or TWO_GPU, "test")


# -- system descriptions --------------------------------------------------------------------
def test_system_round_trips_through_its_toml_writer():
    import tomllib
    s = system_of()
    again = parse_system(tomllib.loads(format_system(s, "a comment")), "again")
    assert again.kinds == s.kinds and again.workers == s.workers and again.links == s.links


def test_routes_go_through_host_without_a_direct_link():
    s = system_of()
    assert s.route("g0", "g1") == [("g0", "host"), ("host", "g1")]
    assert s.route("host", "g0") == [("host", "g0")] and s.route("g0", "g0") == []
    assert s.links[("host", "g0")].bytes_per_s == 16e9     # 128 Gb/s


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["workers"].append({"name": "x", "kind": "tpu"}), "unknown worker kind 'tpu'"),
    (lambda d: d["kinds"]["big"].pop("mem_gbyte_s"), "missing mem_gbyte_s"),
    (lambda d: d["kinds"]["big"].update(mem_gbyte_s=-1), "must be positive"),
    (lambda d: d["workers"][0].update(colour="red"), "unknown key 'colour'"),
    (lambda d: d["workers"].append({"name": "cpu", "kind": "cpu2"}), "two workers are named 'cpu'"),
    (lambda d: d["links"].pop(), "no link from"),
    (lambda d: d["links"][0].update(nodes=["host", "g9"]), "'g9' is no worker's memory node"),
    (lambda d: d.update(workers=[]), "no [[workers]]"),
])
def test_bad_system_descriptions_say_what_is_wrong(edit, message):
    import copy
    data = copy.deepcopy(TWO_GPU)
    edit(data)
    with pytest.raises(SystemDescriptionError, match=message.replace("[", r"\[")):
        parse_system(data, "test")


def test_bad_toml_is_a_clear_error(tmp_path):
    from modelcache.placement.system import load_system
    (tmp_path / "s.toml").write_text("[kinds\nname=")
    with pytest.raises(SystemDescriptionError, match="not valid TOML"):
        load_system(tmp_path / "s.toml")
    with pytest.raises(SystemDescriptionError, match="does not exist"):
        load_system(tmp_path / "none.toml")


# -- costs ---------------------------------------------------------------------------------
def test_flops_from_profiler_shapes():
    conv = flops_of("Conv", [{"float": [1, 64, 56, 56]}, {"float": [256, 64, 1, 1]}], [{"float": [1, 256, 56, 56]}])
    assert conv == 2 * 256 * 56 * 56 * 64
    gemm = flops_of("Gemm", [{"float": [1, 2048]}, {"float": [1000, 2048]}], [{"float": [1, 1000]}])
    assert gemm == 2 * 1000 * 2048
    assert flops_of("Relu", [{"float": [1, 10]}], [{"float": [1, 10]}]) == 10


def test_modelled_kinds_are_calibrated_on_the_measured_one():
    s = system_of()
    facts = [NodeFacts("c", "Conv", 1e9, 1e6, 1e6, [1e6], {"cpu2": 0.04}),      # roofline on cpu2: 20 ms
             NodeFacts("r", "Relu", 1e6, 0, 8e6, [4e6], {"cpu2": 0.002})]       # roofline: 0.8 ms
    table = build_table("m", facts, [1e5, 1e6, 4e6], s, batch=2)
    assert "measured" in table.source["cpu2"] and "modelled" in table.source["big"]
    assert table.seconds("cpu2", 0, 2, 2) == pytest.approx(2 * 0.042)          # measured, linear in the batch
    # conv runs at half its roofline on the CPU (20 ms model / 40 ms measured): the big kind too
    big = s.kinds["big"]
    assert table.seconds("big", 0, 1, 1) == pytest.approx(roofline_s(big, facts[0], 1) / 0.5 + 10e-6)
    assert table.weights(0, 2) == 1e6


# -- plan costs ----------------------------------------------------------------------------
def linear_table(per_sample: dict, cut_bytes, batch=4, weights=None):
    """Node seconds linear in the batch: per_sample[kind] is a list of seconds per node and sample."""
    node_s = {k: np.outer(np.arange(batch + 1), v) for k, v in per_sample.items()}
    return CostTable.from_node_seconds("t", node_s, cut_bytes, weights)


def test_rows_move_in_order_between_splits():
    assert rows_moved([(0, 3), (1, 1)], [(2, 2), (3, 2)]) == [(0, 2, 2), (0, 3, 1), (1, 3, 1)]
    assert rows_moved([(0, 0), (1, 4)], [(2, 4)]) == [(1, 2, 4)]


def test_latency_and_throughput_by_hand():
    s = system_of()
    t = linear_table({"cpu2": [1.0, 1.0], "big": [0.1, 0.1], "small": [0.2, 0.2]}, [16e9, 16e9, 0], batch=2)
    cost = PlanCost(t, s, 2)
    # Both nodes on g0: 2 × 16 GB in over the 16 GB/s link (2 s + 10 µs), 2 × 0.2 s of compute, nothing out.
    one = Plan([Stage(0, 2, (1,), (2,))], 2)
    assert cost.latency_s(one) == pytest.approx(2 + 10e-6 + 0.4)
    # Node 0 on g0, node 1 on g1 (through host: 16 GB/s then 8 GB/s, in parallel as two links... each hop a link)
    two = Plan([Stage(0, 1, (1,), (2,)), Stage(1, 2, (2,), (2,))], 2)
    hop = max(32e9 / 16e9, 32e9 / 8e9) + 10e-6
    assert cost.latency_s(two) == pytest.approx(2 + 10e-6 + 0.2 + hop + 0.4)
    # Pipelined, the host->g1 link is busiest: 4 s per batch.
    assert cost.bottleneck_s(two) == pytest.approx(4 + 10e-6)


def test_memory_capacity_makes_a_plan_infeasible():
    s = system_of()
    t = linear_table({"cpu2": [1.0], "big": [0.1], "small": [0.1]}, [0, 0], batch=1, weights=[10e9])
    cost = PlanCost(t, s, 1)
    assert math.isinf(cost.latency_s(Plan([Stage(0, 1, (2,), (1,))], 1)))     # 10 GB on an 8 GB device
    assert math.isfinite(cost.latency_s(Plan([Stage(0, 1, (1,), (1,))], 1)))


def test_split_balances_unlike_workers():
    s = system_of()
    t = linear_table({"cpu2": [1.0], "big": [0.1], "small": [0.3]}, [0, 0], batch=4)
    splits = SplitSearch(PlanCost(t, s, 4))
    assert splits.stage(0, 1, 0b110).split == (3, 1)    # 0.3 s on each of g0 and g1


# -- the DP and the GA ----------------------------------------------------------------------
def random_case(rng: random.Random):
    n, W = rng.randint(4, 12), rng.randint(2, 3)
    kinds = {f"k{w}": {"conv_gflop_s": 1, "matmul_gflop_s": 1, "other_gflop_s": 1, "mem_gbyte_s": 1}
             for w in range(W)}
    workers = [{"name": f"w{w}", "kind": f"k{w}", "memory_node": f"m{w}"} for w in range(W)]
    links = [{"nodes": ["host", f"m{w}"], "gbit_per_s": rng.choice([8, 32, 128]), "latency_us": 5} for w in range(W)]
    if W == 3 and rng.random() < 0.5:
        links.append({"nodes": ["m0", "m1"], "gbit_per_s": 256})
    system = parse_system({"name": "random", "kinds": kinds, "workers": workers, "links": links}, "random")
    batch = 2
    node_s = {}
    for w in range(W):
        speed = rng.uniform(0.3, 3)
        per = [rng.uniform(0.1, 2) * speed * rng.choice([1, 1, 4]) / 1e3 for _ in range(n)]
        node_s[f"k{w}"] = np.outer(np.arange(batch + 1), per) + np.outer(np.arange(batch + 1) > 0, per) * 0.3
    cuts = [rng.uniform(1e5, 4e6) for _ in range(n + 1)]
    return CostTable.from_node_seconds("random", node_s, cuts), system, batch


def test_dp_is_optimal_by_brute_force_on_tiny_chains():
    rng = random.Random(5)
    for _ in range(10):
        table, system, batch = random_case(rng)
        n = min(5, table.n)
        table = CostTable.from_node_seconds("r", {k: np.diff(p, axis=1)[:, :n] for k, p in table.prefix_s.items()},
                                            table.cut_bytes[:n + 1])
        cost = PlanCost(table, system, batch)
        splits = SplitSearch(cost)
        best = optimal_latency_plan(cost, splits)
        W = len(system.workers)
        brute = min(cost.latency_s(Plan([splits.stage(i, j, m) for i, j, m in runs_of(g)], batch))
                    for g in _all_genomes(n, (1 << W) - 1))
        assert cost.latency_s(best) == pytest.approx(brute)


def _all_genomes(n, masks):
    import itertools
    return itertools.product(range(1, masks + 1), repeat=n)


# The first 20 tables in the default run (~6 s); all 100 with the slow tests (~30 s of CPU): the same seeded
# sequence, so the short run is the long run's head.
@pytest.mark.parametrize("cases, needed", [(20, 19), pytest.param(100, 95, marks=pytest.mark.slow)])
def test_ga_finds_the_dp_optimum_in_95_of_100_random_cost_tables(cases, needed):
    rng = random.Random(17)
    hits, misses = 0, []
    for case in range(cases):
        table, system, batch = random_case(rng)
        cost = PlanCost(table, system, batch)
        splits = SplitSearch(cost)
        exact = cost.latency_s(optimal_latency_plan(cost, splits))
        ga = GeneticSearch(cost, seed=case, splits=splits, time_budget_s=30, clock=lambda: 0.0)  # no time cut
        found = cost.latency_s(ga.run())
        assert found >= exact * (1 - 1e-9), "the GA cannot beat the exact optimum"
        if found <= exact * (1 + 1e-9):
            hits += 1
        else:
            misses.append((case, found / exact))
    assert hits >= needed, misses


def test_ga_is_deterministic_for_a_seed():
    table, system, batch = random_case(random.Random(3))
    plans = []
    for _ in range(2):
        cost = PlanCost(table, system, batch)
        plans.append(GeneticSearch(cost, seed=7, clock=lambda: 0.0).run().stages)
    assert plans[0] == plans[1]


def test_baselines_are_what_their_papers_do():
    s = system_of()
    per = {"cpu2": [1.0] * 10, "big": [0.1] * 10, "small": [0.2] * 10}
    cost = PlanCost(linear_table(per, [1e3] * 11, batch=2), s, 2)
    assert fastest_single(cost).stages == [Stage(0, 10, (1,), (2,))]
    half = half_split(cost)   # ungrouped workers are groups of one: cpu, then g0
    assert [(st.start, st.end, st.workers) for st in half.stages] == [(0, 5, (0,)), (5, 10, (1,))]
    tail = tail_fraction(cost, 0.1)
    assert [(st.start, st.end, st.workers) for st in tail.stages] == [(0, 9, (1,)), (9, 10, (2,))]
    assert greedy_by_speed(cost).stages == [Stage(0, 10, (1,), (2,))]


def test_place_beats_or_matches_every_baseline():
    table, system, batch = random_case(random.Random(11))
    for objective in ("latency", "throughput"):
        result = place(table, system, batch, objective, seed=1, time_budget_s=30, clock=lambda: 0.0)
        key = (lambda p: p.latency_s) if objective == "latency" else (lambda p: -p.throughput_per_s)
        assert all(key(result.plan) <= key(b) + 1e-12 for b in result.baselines)


def test_profile_keeps_the_faster_half_of_its_runs():
    from modelcache.placement.profile import fastest_runs
    # run 0 is the warm-up; run 2 was stretched by another process taking a core
    times = {"a": [9.0, 1.0, 3.0, 1.1, 1.0], "b": [9.0, 2.0, 6.0, 2.0, 2.2]}
    assert fastest_runs(times) == [1, 3]
    assert fastest_runs({"a": [5.0, 1.0]}) == [1]
    assert fastest_runs({"a": [5.0]}) == []        # no run besides the warm-up: the caller falls back to all


def tiny_relu_model(path):
    import onnx
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "tiny",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return {"x": np.ones((1, 8), dtype=np.float32)}


def test_node_times_are_scaled_to_each_runs_wall_time():
    """The profiler times kernels only: each run's nodes are stretched to add up to its wall time."""
    from modelcache.executor.profile import to_wall
    scaled = to_wall({"a": [1.0, 2.0], "b": [3.0, 2.0]}, [8.0, 5.0])
    assert scaled == {"a": [2.0, 2.5], "b": [6.0, 2.5]}
    assert to_wall({"a": [1.0, 2.0], "b": [3.0]}, [8.0, 5.0]) == {"a": [1.0, 2.0], "b": [3.0]}   # runs not aligned


def test_a_pooled_profile_adds_each_profile_s_runs_and_summarises_them_two_ways(tmp_path):
    """Profiles taken at several moments pool their runs (warm-ups left out); the summary is the median
    of all of them (the planner's: what a stretch of serving sees) or of the faster half of the runs."""
    from modelcache.placement.profile import PooledProfile

    feeds = tiny_relu_model(tmp_path / "m.onnx")
    pool = PooledProfile(tmp_path / "m.onnx", feeds, [1])
    pool.take(runs=3, min_s=0.0)
    assert len(pool.times[1]["relu"]) == 3
    pool.take(runs=4, min_s=0.0)
    assert len(pool.times[1]["relu"]) == 7
    assert pool.summary()[1]["relu"]["op"] == "Relu"
    # Whole runs are kept or left together: run 1 (index 1) was stretched for both nodes.
    pool.times[1] = {"relu": [1.0, 4.0, 1.2, 1.1], "other": [2.0, 8.0, 2.2, 2.4]}
    pool.args[1]["other"] = {"op_name": "Other"}
    fast, median = pool.summary("faster-half")[1], pool.summary()[1]
    assert fast["relu"]["seconds"] == pytest.approx(1.1) and fast["other"]["seconds"] == pytest.approx(2.1)
    assert median["relu"]["seconds"] == pytest.approx(1.15) and median["other"]["seconds"] == pytest.approx(2.3)


def test_profile_spreads_its_runs_over_min_s(tmp_path, monkeypatch):
    """At least `runs` runs after the warm-up; more, up to max_runs, until they took min_s: a burst of
    another process's work lasts longer than a handful of runs, so the runs kept must span more. Between
    each two, a cold run (after WAKE_GAP_S idle) measures a worker's wake-up."""
    import onnxruntime as ort
    from modelcache.placement import profile

    counted = []
    real = ort.InferenceSession.run

    def run(self, *a, **k):
        counted.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(ort.InferenceSession, "run", run)
    feeds = tiny_relu_model(tmp_path / "m.onnx")
    out = profile.profile_nodes(tmp_path / "m.onnx", feeds, 1, runs=3, min_s=0.0)
    assert len(counted) == 6 and out["relu"]["seconds"] >= 0    # the warm-up, 3 runs and the 2 cold ones between
    counted.clear()
    profile.profile_nodes(tmp_path / "m.onnx", feeds, 1, runs=3, min_s=60.0, max_runs=9)
    assert len(counted) == 18                                    # capped at max_runs (and their cold runs)
    counted.clear()
    profile.profile_nodes(tmp_path / "m.onnx", feeds, 1, runs=3, min_s=0.2)
    assert len(counted) > 6                                      # a tiny run: more runs to fill 200 ms
