"""The timed policies (`keepalive`, `hybrid`), stepped by hand with an injected clock: the deadlines they
set after each call, the actions `due` gives, and the order they evict in under pressure."""

import math

import pytest

from modelcache.eviction import LRU, Action, Hybrid, KeepAlive, SizedHybrid, make_policy
from modelcache.eviction.hybrid import IdleTimes

from fake_clock import FakeClock, at

MIN = 60.0


def call(policy, key, t, size=10, run_s=0.5):
    """One call as the daemon reports it: loaded if need be, leased, let go `run_s` later."""
    if key not in policy.entries:
        at(policy, t).created(key, size)
    at(policy, t).accessed(key)
    at(policy, t + run_s).released(key)


def step(policy, until):
    """Drive the timers as the daemon would, up to `until`: every action with the time it came due;
    an unload is carried out (the model is idle), a pre-warm loads the model at once."""
    got = []
    while (t := policy.next_deadline()) is not None and t <= until:
        for a in at(policy, t).due():
            got.append((t, a.kind, a.key))
            if a.kind == "unload":
                policy.removed(a.key)
            else:
                at(policy, t).created(a.key, 10)
    return got


def test_a_never_seen_model_has_no_timer():
    p = Hybrid(FakeClock(0.0))
    assert p.next_deadline() is None and at(p, 1e9).due() == []
    assert p.keep_alive_until("m") is None and p.predicted_next_call("m") is None


def test_policies_without_timers_answer_nothing_ever():
    p = LRU(FakeClock(0.0))
    at(p, 0).created("a", 10)
    at(p, 1).accessed("a")
    assert p.next_deadline() is None and at(p, 1e9).due() == [] and p.keep_alive_until("a") is None
    assert p.prewarm_victims("b", 5, {"a": 10}) == []


def test_keepalive_unloads_ten_minutes_after_the_last_call():
    p = KeepAlive(FakeClock(0.0))
    call(p, "a", 0)
    assert p.keep_alive_until("a") == 10 * MIN
    call(p, "a", 5 * MIN)                 # a second call moves the window
    assert at(p, 10 * MIN).due() == []
    assert p.keep_alive_until("a") == 15 * MIN
    assert step(p, 1e9) == [(15 * MIN, "unload", "a")]
    assert p.next_deadline() is None      # gone: nothing left to do


def test_a_one_off_call_gets_the_fixed_keep_alive_then_goes():
    p = Hybrid(FakeClock(0.0))
    call(p, "a", 100)
    assert p.predicted_next_call("a") is None          # one call teaches nothing
    assert step(p, 1e9) == [(100 + 10 * MIN, "unload", "a")]


def test_a_model_in_use_is_never_unloaded_its_window_ends_at_release():
    p = KeepAlive(FakeClock(0.0))
    at(p, 0).created("a", 10)
    at(p, 0).accessed("a")                    # leased, and held for 15 minutes
    assert at(p, 10 * MIN).due() == []          # its window ended while in use: nothing
    at(p, 15 * MIN).released("a")
    assert at(p, 15 * MIN).due() == [Action("unload", "a")]


def test_a_replay_shrinks_the_windows_through_the_policys_own_options():
    """No time scale: a replay that compresses trace time either drives a virtual clock (the simulated
    replay) or gives the policy windows as short as the compressed trace's (the real-daemon replay)."""
    p = make_policy("keepalive", FakeClock(0.0), keep_alive_s=10)
    call(p, "a", 0)
    assert p.keep_alive_until("a") == 10.0              # ten minutes of trace in ten seconds
    h = make_policy("hybrid", FakeClock(0.0), keep_alive_s=10, unit_minutes=1 / 60, range_minutes=4)
    assert h.unit_s == pytest.approx(1.0) and h.fallback_s == pytest.approx(10.0) and h.bins == 240


def periodic(p, every_s, n, t0=0.0):
    for i in range(n):
        call(p, "a", t0 + i * every_s)
    return t0 + (n - 1) * every_s


def test_periodic_calls_learn_to_unload_in_between_and_prewarm_just_before():
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 5 * MIN + 10, 6)   # 5 idle times in bin 5 (5-6 minutes): representative
    assert p.representative("a")
    assert p.windows("a") == (5 * MIN, 6 * MIN)            # head and tail, bin edges
    assert p.predicted_next_call("a") == last + 5 * MIN
    got = step(p, last + 20 * MIN)
    assert got == [(last + 0.5, "unload", "a"),            # idle after the call: goes at release
                   (last + 4.5 * MIN, "prewarm", "a"),     # head less 10 %
                   (last + 6.6 * MIN, "unload", "a")]      # tail plus 10 %, no call came
    assert p.keep_alive_until("a") is None                 # not resident


def test_a_call_cancels_the_pending_prewarm_and_plans_again():
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 5 * MIN + 10, 6)
    step(p, last + 1)                                      # unloaded after the call
    call(p, "a", last + 2 * MIN)                           # early: a cold start, and a new plan
    assert p.windows("a") == (2 * MIN, 6 * MIN)            # the early idle time is now the head
    got = step(p, last + 9 * MIN)
    assert (last + 4.5 * MIN, "prewarm", "a") not in got   # the old plan's pre-warm never fires
    # head and tail four bins apart: no longer a timer's pattern, so kept from the call until the tail
    assert got == [(last + 2 * MIN + 6.6 * MIN, "unload", "a")]


def test_spread_idle_times_keep_the_model_from_the_call_instead_of_prewarming():
    """Idle times of 3 to 9 minutes (bursty calls): the 5th percentile is the least of them, and the next
    may well come sooner, so the model is kept from its call to the tail rather than unloaded and
    pre-warmed at the head (which would save 3 of ~6 minutes for a cold start whenever a call is early)."""
    p = Hybrid(FakeClock(0.0))
    t = 0.0
    for i in range(12):
        call(p, "a", t)
        t += (3 + i % 7) * MIN + 10
    call(p, "a", t)
    assert p.representative("a") and p.windows("a") == (3 * MIN, 10 * MIN)
    assert not p.prewarms(p.windows("a"))
    assert p.predicted_next_call("a") == t + 3 * MIN
    assert step(p, t + 20 * MIN) == [(t + 11 * MIN, "unload", "a")]   # tail plus 10 %, nothing in between


def test_a_prewarm_for_a_model_still_resident_loads_nothing_but_keeps_it():
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 5 * MIN + 10, 6)
    at(p, last).created("a", 10)               # (still resident: the tier has not acted on the unload)
    at(p, last + 1).accessed("a")              # held across its pre-warm time
    assert at(p, last + 1 + 4.5 * MIN).due() == []                  # nothing to load, nor to unload (in use)
    at(p, last + 5 * MIN).released("a")
    assert at(p, last + 5 * MIN).due() == []                        # the pre-warm's window has begun: it stays
    assert p.keep_alive_until("a") == last + 1 + 6.6 * MIN


def test_bursts_with_long_gaps_keep_the_model_across_the_gap():
    """Bursts of calls 10 s apart for two minutes, then 30 minutes idle: the burst's calls count one
    idle time a minute (as the paper's per-minute counts do), so the 30-minute gaps reach the tail."""
    p, k = Hybrid(FakeClock(0.0)), KeepAlive(FakeClock(0.0))
    t = 0.0
    for _ in range(5):
        for i in range(12):
            call(p, "a", t + 10 * i)
            call(k, "a", t + 10 * i)
        t += 110 + 30 * MIN
        step(p, t - 1)
        step(k, t - 1)
    assert p.representative("a")
    head, tail = p.windows("a")
    assert head == 0 and tail >= 30 * MIN
    assert "a" in p.entries and "a" not in k.entries     # hybrid kept it over the gap; keep-alive let it go


def test_spread_out_idle_times_are_not_representative():
    """Idle times over 120 of the 240 minutes, evenly: CV 1. (With fewer idle times than bins even an
    even spread has a high CV: n in n bins gives sqrt(240/n - 1), over 2 below 48 distinct minutes.)"""
    p = Hybrid(FakeClock(0.0))
    t = 0.0
    for i in range(240):
        t += (i % 120 + 0.5) * MIN
        call(p, "a", t)
    assert p.idle["a"].cv() == pytest.approx(1.0, abs=0.02) and not p.representative("a")
    assert p.keep_alive_until("a") == t + 10 * MIN       # the fixed keep-alive


def test_mostly_out_of_range_idle_times_are_not_representative():
    p = Hybrid(FakeClock(0.0))
    periodic(p, 5 * 60 * MIN, 8)          # every 5 hours: beyond the 4-hour range
    assert p.idle["a"].out_of_bounds == 7 and not p.representative("a")


def test_too_few_idle_times_are_not_representative():
    p = Hybrid(FakeClock(0.0))
    periodic(p, 5 * MIN + 10, 3)          # 2 idle times, however concentrated: < min_concentrated_samples
    assert not p.representative("a") and p.predicted_next_call("a") is None
    q = Hybrid(FakeClock(0.0))
    t = 0.0
    for gap in (3, 9, 5, 1):              # 4 spread idle times: < min_samples
        call(q, "a", t)
        t += gap * MIN + 10
    call(q, "a", t)
    assert not q.representative("a") and q.keep_alive_until("a") == t + 10 * MIN


def test_a_timer_is_trusted_after_three_idle_times_and_an_early_call_ends_the_trust():
    """Three idle times in one bin: a concentrated pattern is trusted before the five a spread one needs
    (module docstring of `representative`: unlikely by chance, and a mistake costs one call)."""
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 30 * MIN + 10, 4)                   # 3 idle times in bin 30
    assert p.representative("a") and p.windows("a") == (30 * MIN, 31 * MIN)
    assert step(p, last + 40 * MIN) == [(last + 0.5, "unload", "a"),          # goes at release
                                        (last + 27 * MIN, "prewarm", "a"),    # head less 10 %
                                        (last + 31 * 1.1 * MIN, "unload", "a")]
    t = last + 45 * MIN                                    # late: a 45-minute idle time
    call(p, "a", t)                                        # 4 idle times, one far from the others
    assert not p.representative("a") and p.windows("a") is None
    assert p.keep_alive_until("a") == t + 10 * MIN         # back to the fixed keep-alive


def test_under_pressure_the_furthest_expected_call_and_the_most_bytes_go_first():
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 30 * MIN + 10, 7)                   # next call expected 30 minutes after `last`
    call(p, "b", last - 60, size=10)                       # one call a minute ago
    call(p, "c", last - 600, size=10)                      # one call ten minutes ago
    at(p, last + 1).created("a", 10)
    at(p, last + 60).due()                                       # (tell the policy the time)
    # a: ~29 minutes to its expected call; c: idle 11 min; b: idle 2 min
    assert p.order(["a", "b", "c"]) == ["a", "c", "b"]
    call(p, "big", last + 55, size=1000)                   # idle one second, but 100x the bytes
    at(p, last + 60).due()
    assert p.order(["big", "b"])[0] == "big"


def test_under_pressure_a_model_called_less_often_goes_before_one_idle_longer_but_busier():
    """Both kept from their calls (head 0): "a" called every 40 s, last 10 s ago; "b" every second, last
    20 s ago. b's next call is any second, a's some 30 s off: a goes first (LRU's order said b)."""
    p = Hybrid(FakeClock(0.0))
    for i in range(30):
        call(p, "a", 40.0 * i)
    t = 40.0 * 29 + 10
    for i in range(400):
        call(p, "b", t - 20 - 399 + i)
    at(p, t).due()
    assert p.windows("a")[0] == p.windows("b")[0] == 0
    assert p.time_to_next_call("a") == pytest.approx(40) and p.time_to_next_call("b") == pytest.approx(20)
    assert p.order(["a", "b"]) == ["a", "b"]


def test_a_prewarmed_model_whose_call_is_due_is_not_taken_for_a_long_idle_one():
    """After its pre-warm a periodic model has been idle most of its period; its call is minutes away
    (the histogram's mean idle time still to come), so under pressure a model idle for less time but
    with no pattern goes first. (Ordered by how long it had been idle, capped at the window's end, the
    pre-warmed model went first and its call was a cold start.)"""
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 30 * MIN + 10, 7)                   # idle times in bin 30: head 30, tail 31 minutes
    step(p, last + 28 * MIN)                               # unloaded, then pre-warmed at 27 minutes
    assert "a" in p.entries and p.predicted_next_call("a") == last + 30 * MIN
    call(p, "c", last + 23 * MIN)                          # one call, five minutes ago
    at(p, last + 28 * MIN).due()
    assert p.time_to_next_call("a") == pytest.approx(2.5 * MIN)   # bin 30's middle, less the 28 minutes
    assert p.order(["a", "c"]) == ["c", "a"]
    assert step(p, last + 40 * MIN) == [(last + 33 * MIN, "unload", "c"),          # its fixed keep-alive
                                        (last + 31 * 1.1 * MIN, "unload", "a")]    # no call: the tail


def test_mean_idle_time_still_to_come():
    h = IdleTimes(bins=240, unit_s=60)
    for s in (30, 330, 330, 14400):                        # bins 0, 5, 5 and one beyond the range
        h.add(s)
    assert h.mean_residual_s(0) == pytest.approx((30 + 330 + 330 + 14400) / 4)
    assert h.mean_residual_s(300) == pytest.approx((30 + 30 + 14100) / 3)   # bin 0 is over
    assert h.mean_residual_s(14500) == 0                    # only the out-of-range one: at least the range
    empty = IdleTimes(bins=240, unit_s=60)
    assert empty.mean_residual_s(0) is None


def test_a_prewarm_displaces_only_models_expected_later():
    p = Hybrid(FakeClock(0.0))
    last = periodic(p, 5 * MIN + 10, 6)                    # a: expected 5 minutes after `last`
    step(p, last + 1)                                      # a unloaded
    call(p, "hot", last + 4 * MIN, size=10)                # called just before a's pre-warm
    call(p, "cold", last - 60 * MIN, size=10)              # idle an hour
    at(p, last + 4.5 * MIN - 1).due()
    assert p.prewarm_victims("a", 10, {"hot": 10, "cold": 10}) == ["cold"]
    assert p.prewarm_victims("a", 20, {"hot": 10, "cold": 10}) == []


def test_idle_time_histogram_edges_percentiles_and_cv():
    h = IdleTimes(bins=240, unit_s=60)
    for s in (0, 59.9, 60, 300, 14400):
        h.add(s)
    assert h.counts[0] == 2 and h.counts[1] == 1 and h.counts[5] == 1 and h.out_of_bounds == 1
    assert h.percentile_s(5, upper=False) == 0 and h.percentile_s(99, upper=True) == 6 * 60
    one = IdleTimes(bins=240, unit_s=60)
    for _ in range(10):
        one.add(125)
    assert one.cv() == pytest.approx(math.sqrt(239))      # one sharp peak: the highest CV there is


def test_replanning_does_not_grow_the_timer_heap_without_bound():
    p = Hybrid(FakeClock(0.0))
    for i in range(10_000):                       # one busy model, a call a second: each call replans
        call(p, "a", float(i))
    assert len(p._heap) <= 2 * len(p._pending) + 65
    assert p.windows("a") == (0, MIN)                        # idle times of a second: head 0, tail a minute
    assert step(p, 1e9) == [(9_999 + 1.1 * MIN, "unload", "a")]   # only the last plan's deadline fires


def test_cheapest_keep_alive_weighs_waiting_against_the_calls_it_catches():
    """8 idle times under a minute, 2 of 30 minutes: keeping past the burst costs ~29 minutes of waiting per
    gap for the gap's call. Worth it when a cold start is worth more than that (a small model), not at 10
    minutes (one of the mean size)."""
    h = IdleTimes(bins=240, unit_s=60)
    for s in [20] * 8 + [30 * MIN + 5] * 2:
        h.add(s)
    assert h.cheapest_keep_s(10 * MIN) == MIN              # (8x30 + 2x60 + 2x600) / 10 = 156 s a call
    assert h.cheapest_keep_s(100 * MIN) == 31 * MIN        # (8x30 + 2x1830) / 10 = 390 s a call
    assert IdleTimes(bins=240, unit_s=60).cheapest_keep_s(10 * MIN) == 0


def test_size_aware_keeps_a_small_model_across_a_gap_and_lets_a_large_one_go():
    """Same calls, sizes 10 and 1000: at the fixed keep-alive's exchange rate (the mean model's size x 10
    minutes) the small model's cold start is worth 505 minutes of holding it, the large one's 6."""
    p = SizedHybrid(FakeClock(0.0))
    t = 0.0
    for _ in range(6):
        for i in range(3):
            for key, size in (("small", 10), ("big", 1000)):
                call(p, key, t + 30 * i, size=size)
        t += 60 + 30 * MIN
        step(p, t - 1)
    assert p.windows("small") == p.windows("big")          # one pattern: head 0, tail 31 minutes
    assert p.cold_start_value_s("small") == pytest.approx(505 / 10 * 10 * MIN)
    assert "small" in p.entries and "big" not in p.entries
    last = t - 60 - 30 * MIN + 60
    assert p.keep_alive_until("small") == pytest.approx(last + 31 * 1.1 * MIN)
    assert Hybrid(FakeClock(0.0)).keep_s("big", 31 * MIN) == 31 * MIN    # plain hybrid: the paper's tail
    assert make_policy("hybrid-sized", FakeClock(0.0), keep_alive_s=300).cold_start_value_s("any") == 300   # the operator's rate
