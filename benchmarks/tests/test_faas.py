"""FaaS traces and their replay: the Azure Functions format read back exactly, models mapped and calls
spread with a seed, the synthetic trace's shape, and the discrete-event replay on hand-built calls."""

import json
from collections import Counter

import pytest

from benchmarks.faas.attribute import AttributedReplay, function_classes, report
from benchmarks.faas.simulate import Costs, replay, trace_policy
from benchmarks.faas.sweep import compare, frontier, interpolate, main, verdict, verdict_line
from benchmarks.faas.synthetic import generate
from benchmarks.faas.trace import (FunctionCounts, Invocation, assign_models, invocations, read_counts,
                                   write_counts, zoo_catalogue)

AZURE = "HashOwner,HashApp,HashFunction,Trigger," + ",".join(str(m) for m in range(1, 6)) + "\n"


def test_reads_the_azure_2019_format(tmp_path):
    p = tmp_path / "invocations.csv"
    p.write_text(AZURE + "o1,a1,f1,http,0,2,0,0,1\no2,a2,f2,timer,1,1,1,1,1\n")
    rows = read_counts(p)
    assert [(r.id, r.trigger, r.first_minute, r.counts) for r in rows] == [
        ("a1/f1", "http", 1, (0, 2, 0, 0, 1)), ("a2/f2", "timer", 1, (1, 1, 1, 1, 1))]


def test_reads_the_variants_in_invitro(tmp_path):
    """minute_N names, the hash columns reordered, no Trigger, a later first minute, an extra column."""
    p = tmp_path / "v.csv"
    p.write_text("HashApp,HashFunction,HashOwner,minute_540,minute_541,start_timestamp\nad,fe,ob,1,2,0.0\n")
    [r] = read_counts(p)
    assert (r.owner, r.app, r.function, r.trigger, r.first_minute, r.counts) == ("ob", "ad", "fe", "", 540, (1, 2))


@pytest.mark.parametrize("text, says", [
    ("a,b,c\n1,2,3\n", "missing HashOwner"),
    ("HashOwner,HashApp,HashFunction,Trigger\no,a,f,http\n", "missing minute columns"),
    ("HashOwner,HashApp,HashFunction,1,3\no,a,f,1,1\n", "not consecutive"),
    ("HashOwner,HashApp,HashFunction,1,2\no,a,f,1,x\n", ":2: a minute count is not a number"),
    ("", "empty file"),
])
def test_a_file_that_is_not_a_trace_is_one_clear_error(tmp_path, text, says):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(ValueError, match=says) as e:
        read_counts(p)
    assert "\n" not in str(e.value)


def test_a_slice_cut_from_two_places_is_read_one_run_at_a_time(tmp_path):
    """A sample whose minute columns jump (1-3 then 546-549) never lays counts across the minutes it lacks:
    a window inside one run reads that run; no window, or one across the gap, is an error naming the runs."""
    p = tmp_path / "cut.csv"
    p.write_text("HashOwner,HashApp,HashFunction,Trigger,1,2,3,546,547,548,549\no,a,f,timer,1,0,0,0,1,0,1\n")
    [r] = read_counts(p, (546, 550))
    assert (r.first_minute, r.counts) == (546, (0, 1, 0, 1))
    [r] = read_counts(p, (1, 3))
    assert (r.first_minute, r.counts) == (1, (1, 0, 0))
    for window in (None, (3, 547)):
        with pytest.raises(ValueError, match=r"not consecutive \(runs 1-3, 546-549\).*--minutes 546:550"):
            read_counts(p, window)


def test_the_committed_azure_slice_is_the_file_its_readme_names_and_reads_in_its_window():
    """The real-trace slice under benchmarks/faas is copied unchanged (its README gives the digest and where
    it comes from); read in the consecutive minutes the benchmarks replay, it is 100 functions x 144 minutes."""
    import hashlib
    from pathlib import Path
    folder = Path(__file__).resolve().parents[1] / "faas" / "azure-2019-slice"
    data = (folder / "invocations.csv").read_bytes()
    assert hashlib.sha256(data).hexdigest() in (folder / "README.md").read_text()
    rows = read_counts(folder / "invocations.csv", (546, 690))
    assert len(rows) == 100 and {(r.first_minute, len(r.counts)) for r in rows} == {(546, 144)}
    assert sum(sum(r.counts) for r in rows) == 183587
    with pytest.raises(ValueError, match="runs 1-6, 546-689"):
        read_counts(folder / "invocations.csv")


def test_the_sweep_says_what_a_bad_window_is(tmp_path, capsys):
    p = tmp_path / "t.csv"
    p.write_text(AZURE + "o,a,f,http,1,1,1,1,1\n")
    for bad, says in (("5", "FIRST:STOP"), ("4:2", "STOP must be after FIRST")):
        with pytest.raises(SystemExit):
            main(["--trace", str(p), "--minutes", bad, "--capacities", "1", "--policies", "lru"])
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("minute_names", [False, True])
def test_written_traces_read_back_the_same(tmp_path, minute_names):
    rows = generate(functions=12, hours=0.5, seed=3)
    write_counts(tmp_path / "t.csv", rows, minute_names=minute_names)
    assert read_counts(tmp_path / "t.csv") == rows


def fake_functions(n):
    return [FunctionCounts("o", f"a{i}", f"f{i}", "http", 1, (1,)) for i in range(n)]


def test_each_function_gets_its_own_copy_of_a_seeded_model():
    fs = fake_functions(50)
    catalogue = [("small", 10), ("big", 1000)]
    m = assign_models(fs, catalogue, seed=1)
    assert m == assign_models(fs, catalogue, seed=1) != assign_models(fs, catalogue, seed=2)
    assert len({name for name, _ in m.values()}) == 50                      # own copies: name#i
    assert {name.split("#")[0] for name, _ in m.values()} == {"small", "big"}
    assert all(size == dict(catalogue)[name.split("#")[0]] for name, size in m.values())
    shared = assign_models(fs, catalogue, seed=1, shared=True)
    assert {name for name, _ in shared.values()} == {"small", "big"}
    with pytest.raises(ValueError, match="catalogue is empty"):
        assign_models(fs, [], seed=1)


def test_the_zoo_catalogue_sizes_follow_the_published_parameter_counts():
    sizes = dict(zoo_catalogue())
    assert sizes["resnet50"] == 4 * 25_557_032 and sizes["resnet50-fp16"] == 2 * 25_557_032
    assert not any(name.startswith("tiny") for name in sizes)


def test_invocations_spread_inside_their_minute_in_time_order_and_compressed():
    fs = [FunctionCounts("o", "a", "f", "http", 1, (3, 0, 2)), FunctionCounts("o", "b", "g", "timer", 1, (1, 1, 1))]
    models = {"a/f": ("m1", 10), "b/g": ("m2", 10)}
    calls = invocations(fs, models, seed=7)
    assert calls == invocations(fs, models, seed=7) != invocations(fs, models, seed=8)
    assert [c.t for c in calls] == sorted(c.t for c in calls)
    per_minute = Counter((c.function, int(c.t // 60)) for c in calls)
    assert per_minute == {("a/f", 0): 3, ("a/f", 2): 2, ("b/g", 0): 1, ("b/g", 1): 1, ("b/g", 2): 1}
    assert {c.model for c in calls if c.function == "a/f"} == {"m1"}
    fast = invocations(fs, models, seed=7, compress=60)
    assert [c.t for c in fast] == pytest.approx([c.t / 60 for c in calls])
    window = invocations(fs, models, seed=7, minutes=(2, 4))     # the trace's minutes 2 and 3
    assert Counter(c.function for c in window) == {"a/f": 2, "b/g": 2}
    assert sorted(int(c.t // 60) for c in window) == [0, 1, 1, 1]          # time from the window's start
    with pytest.raises(ValueError, match="compress must be positive"):
        invocations(fs, models, compress=0)


def test_the_synthetic_trace_has_the_published_shape():
    rows = generate(functions=300, hours=6, seed=0)
    assert rows == generate(functions=300, hours=6, seed=0)
    totals = sorted((sum(r.counts) for r in rows), reverse=True)
    assert sum(totals[:30]) > 0.8 * sum(totals)                      # the top 10 % make most of the calls
    assert sum(t <= 6 for t in totals) > 0.2 * len(rows)              # many are called about once an hour or less
    assert sum(t == 0 for t in totals) < 0.05 * len(rows)             # (a bursty one may stay off all along)
    timers = [r for r in rows if r.trigger == "timer"]
    assert len(timers) > 0.05 * len(rows)
    for r in timers:                                                  # one call every k minutes
        minutes = [m for m, c in enumerate(r.counts) if c]
        assert all(c == 1 for c in r.counts if c) and len({b - a for a, b in zip(minutes, minutes[1:])}) <= 1
    calls = invocations(rows, assign_models(rows, [("m", 1)], shared=True), seed=0)
    by_function = {}
    for c in calls:
        by_function.setdefault(c.function, []).append(c.t)
    gaps = [b - a for ts in by_function.values() for a, b in zip(ts, ts[1:])]
    assert min(gaps) < 5 and max(gaps) > 3 * 3600                      # idle times from seconds to hours


# -- the replay, on hand-built calls ------------------------------------------------------------------
COSTS = Costs(open_host_s=0.0, open_disk_s=0.5, promote_s_per_byte=0.0, run_s={}, default_run_s=1.0)


def calls(*spec):
    return [Invocation(t, f"fn-{m}", m) for t, m in spec]


def test_a_call_that_finds_the_tier_full_of_models_in_use_waits_for_room():
    r = replay(trace_policy("lru"), 100, calls((0.0, "A"), (0.1, "B")), {"A": 60, "B": 60}, COSTS)
    assert (r.disk_misses, r.host_hits, r.refused, r.unserved, r.waited_for_room) == (2, 0, 0, 0, 1)
    # A: loaded at 0.5, runs to 1.5; B waits for A's end, then loads (0.5) and runs (1)
    assert r.ttfr_s == pytest.approx([1.5, 1.5 + 0.5 + 1.0 - 0.1])
    assert r.peak_bytes == 60 and r.evictions == 1


def test_waiting_calls_are_served_in_arrival_order():
    spec = calls((0.0, "A"), (0.1, "B"), (0.2, "C"))
    r = replay(trace_policy("lru"), 100, spec, {"A": 60, "B": 60, "C": 60}, COSTS)
    assert r.ttfr_s == pytest.approx([1.5, 2.9, 4.3])   # B starts loading when A ends (1.5), C when B ends (3.0)


def test_a_model_bigger_than_the_tier_is_refused_and_nothing_else_moves():
    r = replay(trace_policy("lru"), 100, calls((0.0, "A"), (1.0, "huge")), {"A": 60, "huge": 101}, COSTS)
    assert (r.refused, r.disk_misses, r.evictions, r.calls) == (1, 1, 0, 2)


def test_memory_time_counts_bytes_while_resident():
    # keep-alive 10 min: A loads from 0 to 0.5 (its bytes count while they are copied), the call gets its
    # lease at 0.5 and runs to 1.5, A goes at 600.5 (10 minutes after the call)
    r = replay(trace_policy("keepalive"), 100, calls((0.0, "A"), (2000.0, "A")), {"A": 50}, COSTS)
    assert r.unloads == 1 and r.disk_misses == 2
    # then loaded again at 2000 until the trace's end, 2001.5
    assert r.byte_s == pytest.approx(50 * 600.5 + 50 * 1.5)
    lru = replay(trace_policy("lru"), 100, calls((0.0, "A"), (2000.0, "A")), {"A": 50}, COSTS)
    assert (lru.disk_misses, lru.host_hits) == (1, 1) and lru.byte_s == pytest.approx(50 * 2001)   # a hit: no load


def periodic_calls(model, every_s, n, t0=0.0):
    return [(t0 + i * every_s, model) for i in range(n)]


def test_hybrid_prewarms_a_periodic_model_and_holds_it_only_around_its_calls():
    spec = calls(*periodic_calls("P", 30 * 60 + 10, 20))
    sizes = {"P": 50}
    hybrid = replay(trace_policy("hybrid"), 100, spec, sizes, COSTS)
    keepalive = replay(trace_policy("keepalive"), 100, spec, sizes, COSTS)
    # learning: 4 calls cold (3 concentrated idle times make it representative), then every call finds it
    # pre-warmed
    assert hybrid.disk_misses == 4 and hybrid.prewarms == 16 and hybrid.wasted_prewarms == 0
    assert keepalive.disk_misses == 20                               # 30 minutes apart: always gone
    assert hybrid.byte_s < 0.3 * 50 * spec[-1].t                     # resident ~3.5 of every 30 minutes
    assert hybrid.peak_bytes <= 100


def test_a_prewarm_nobody_calls_is_counted_wasted():
    spec = calls(*periodic_calls("P", 30 * 60 + 10, 7), (7 * 1810 + 3 * 3600, "Q"))   # P stops calling
    r = replay(trace_policy("hybrid"), 100, spec, {"P": 50, "Q": 10}, COSTS)
    # learned after the 4th call: the 5th to 7th find P pre-warmed; the pre-warm after the 7th waits in vain
    assert (r.prewarms, r.host_hits, r.wasted_prewarms) == (4, 3, 1)


def test_under_pressure_capacity_is_never_exceeded():
    rows = generate(functions=40, hours=1, seed=1)
    models = assign_models(rows, [("s", 10), ("m", 40), ("l", 90)], seed=1)
    sizes = dict(models.values())
    trace = invocations(rows, models, seed=1)
    for name in ("lru", "keepalive", "gdsf", "hybrid", "hybrid-sized"):
        r = replay(trace_policy(name), 200, trace, sizes, COSTS)
        assert r.peak_bytes <= 200 and r.unserved == 0
        assert r.host_hits + r.disk_misses == r.calls == len(trace)


def test_each_cold_start_is_attributed_to_why_its_model_was_not_resident():
    """Keep-alive 10 min, room for one model: A's first call, a warm call 30 s later, B's first call
    (A goes), A again (evicted), A 20 minutes later (unloaded after its window)."""
    spec = calls((0.0, "A"), (30.0, "A"), (60.0, "B"), (100.0, "A"), (1300.0, "A"))
    r = AttributedReplay(trace_policy("keepalive"), 100, {"A": 60, "B": 60}, {"A": "timer"}, COSTS)
    res = r.run(spec)
    assert r.cold == {("timer", "first call"): 1, ("other", "first call"): 1, ("timer", "evicted"): 1,
                      ("timer", "unloaded after its window"): 1}
    assert sum(r.cold.values()) == res.disk_misses == 4
    # idle until freed, from the later of the last call's arrival and the load: B from its load (60.5) to
    # its eviction (100); A from its load (100.5) to its unload 10 minutes after its lease (700.5); A from
    # its call (30) to its eviction (60)
    assert r.idle_gib_s[("other", "evicted")] == pytest.approx(60 * 39.5 / 2**30)
    assert r.idle_gib_s[("timer", "unloaded after its window")] == pytest.approx(60 * 600 / 2**30)
    assert r.idle_gib_s[("timer", "evicted")] == pytest.approx(60 * 30 / 2**30)
    # kept until a warm call: A from its load (0.5) to the call at 30
    assert r.kept_calls == {("timer", "< 1 min"): 1}
    assert r.kept_gib_s[("timer", "< 1 min")] == pytest.approx(60 * 29.5 / 2**30)
    assert "timer  unloaded after its window" in report(r)


def test_functions_are_timers_rare_or_other():
    rows = [FunctionCounts("o", "a", f, trig, 1, (0,) * 60)
            for f, trig in (("t", "timer"), ("r", "http"), ("b", "http"))]
    models = {r.id: (f"m-{r.function}", 1) for r in rows}
    spec = [Invocation(float(i), "a/t", "m-t") for i in range(50)] + [Invocation(1.0, "a/r", "m-r")] * 6 \
        + [Invocation(2.0, "a/b", "m-b")] * 7
    assert function_classes(rows, models, spec, hours=6) == {"m-t": "timer", "m-r": "rare", "m-b": "other"}


# -- the sweep -----------------------------------------------------------------------------------------
def test_the_front_and_the_comparison_at_equal_memory_and_equal_cold_starts():
    front = frontier([(10, 0.5), (20, 0.2), (15, 0.6), (40, 0.1)])
    assert front == [(10, 0.5), (20, 0.2), (40, 0.1)]
    # straight on log-log axes: halfway (geometrically) in memory-time is halfway in cold fraction
    assert interpolate(front, 20 * 2**0.5, 0) == pytest.approx(0.2 / 2**0.5)
    assert interpolate(front, 0.2 / 2**0.5, 1) == pytest.approx(20 * 2**0.5)
    assert interpolate(front, 50, 0) is None and interpolate(front, 0.05, 1) is None
    rows = [{"policy": "lru", "capacity_gib": 1, "gib_s": 20, "cold_fraction": 0.2},
            {"policy": "gdsf", "capacity_gib": 1, "gib_s": 21, "cold_fraction": 0.15},
            {"policy": "lru", "capacity_gib": 2, "gib_s": 40, "cold_fraction": 0.1},
            {"policy": "hybrid", "capacity_gib": 1, "gib_s": 30, "cold_fraction": 0.05},
            {"policy": "hybrid", "capacity_gib": 2, "gib_s": 45, "cold_fraction": 0.12}]
    good, bad = compare(rows)
    assert good["cold_ratio"] == pytest.approx(0.05 / interpolate(frontier([(20, .2), (21, .15), (40, .1)]), 30, 0))
    assert good["mem_ratio"] is None                           # fewer cold starts than any baseline point
    assert (good["same_capacity_best"], good["same_capacity_cold_ratio"]) == ("gdsf", pytest.approx(0.05 / 0.15))
    assert not good["worse_than_lru_on_both"] and bad["worse_than_lru_on_both"]
    v = verdict([good, bad])
    assert v["cold_ratio"]["best"] == good["cold_ratio"] and v["cold_ratio"]["met_at_gib"] == [1]   # ~0.27x
    assert v["mem_ratio"]["best"] == bad["mem_ratio"] > 1 and v["mem_ratio"]["met_at_gib"] == []   # good: none
    assert v["worse_than_lru_on_both_at_gib"] == [2]
    line = verdict_line(v)
    assert "best 1.50x (at 2.00 GiB), met nowhere" in line and line.endswith("worse than LRU on both: 2.00 GiB")


def test_the_sweep_runs_end_to_end_on_a_tiny_trace(tmp_path, capsys):
    assert main(["--functions", "12", "--hours", "0.5", "--capacities", "0.3,1", "--out", str(tmp_path),
                 "--policies", "lru,keepalive,gdsf,hybrid,hybrid-sized"]) == 0
    out = json.loads((tmp_path / "results.json").read_text())
    assert {r["policy"] for r in out["rows"]} == {"lru", "keepalive", "gdsf", "hybrid", "hybrid-sized"}
    assert len(out["rows"]) == 10 and set(out["targets"]) == set(out["vs_baselines"]) == {"hybrid", "hybrid-sized"}
    assert read_counts(tmp_path / "trace.csv")                       # the trace it ran, in the Azure format
    printed = capsys.readouterr().out
    assert "cold %" in printed and printed.count(" hybrid |") == 2 and printed.startswith("python -m benchmarks.faas.sweep --functions 12")
    assert "hybrid-sized: targets (issue #29)" in printed
    assert "hybrid at" in printed and "hybrid: targets (issue #29): cold starts at equal memory-time <= 0.5x" in printed
    assert set(out["targets"]["hybrid"]) == {"cold_ratio", "mem_ratio", "worse_than_lru_on_both_at_gib"}


def test_the_summary_prints_the_readme_tables_from_a_sweeps_folder(tmp_path, capsys):
    from benchmarks.faas import summary
    assert main(["--functions", "12", "--hours", "0.5", "--capacities", "0.3,1", "--out", str(tmp_path),
                 "--policies", "lru,gdsf,hybrid"]) == 0
    capsys.readouterr()
    assert summary.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert lines[0].startswith("### synthetic, 12 functions, 0.5 h, seed 0 (")
    assert "| capacity | lru | gdsf | hybrid | hybrid: on the front |" in lines
    rows = [line for line in lines if line.startswith("| ") and "GiB (" in line]
    assert len(rows) == 2 and rows[1].startswith("| ") and "(100%)" in rows[1]
    assert "`hybrid`: targets (issue #29)" in printed
    with pytest.raises(SystemExit) as e:
        summary.main([str(tmp_path / "nosuch")])
    assert e.value.code == 2 and "make one with `python -m benchmarks.faas.sweep" in capsys.readouterr().err


def test_the_sweep_takes_measured_costs_from_a_file(tmp_path, capsys):
    slow = Costs(open_host_s=0.5, run_s={}, default_run_s=1.0)        # every call at least 1.5 s
    (tmp_path / "costs.json").write_text(json.dumps(vars(slow)))
    args = ["--functions", "6", "--hours", "0.2", "--policies", "lru", "--capacities", "1", "--out", str(tmp_path)]
    assert main([*args, "--costs", str(tmp_path / "costs.json")]) == 0
    out = json.loads((tmp_path / "results.json").read_text())
    assert out["costs"]["open_host_s"] == 0.5 and out["rows"][0]["ttfr_p50_ms"] >= 1500


def test_a_costs_file_that_is_not_costs_is_one_clear_error(tmp_path, capsys):
    (tmp_path / "costs.json").write_text(json.dumps({"open_host": 1}))
    with pytest.raises(SystemExit) as e:
        main(["--functions", "2", "--hours", "0.1", "--costs", str(tmp_path / "costs.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "cannot read simulator costs" in err and "open_host" in err and "costs.json" in err
