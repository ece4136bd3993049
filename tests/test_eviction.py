"""Eviction policies, stepped by hand with an injected clock: exact victims expected."""

import pytest

from modelcache.eviction import FIFO, GDSF, LFU, LRU, Eager, Never, make_policy

from fake_clock import FakeClock, at

MiB = 2**20


def fill(policy, sizes: dict, t0: float = 0.0):
    for i, (key, size) in enumerate(sizes.items()):
        at(policy, t0 + i).created(key, size)
    return policy


def test_lru_evicts_least_recently_used_until_enough():
    p = fill(LRU(FakeClock(0.0)), {"a": 10, "b": 10, "c": 10})
    at(p, 10).accessed("a")          # a is now the most recent; b is the oldest
    assert p.choose_victims(5, {"a": 10, "b": 10, "c": 10}) == ["b"]
    assert p.choose_victims(15, {"a": 10, "b": 10, "c": 10}) == ["b", "c"]
    assert p.choose_victims(25, {"a": 10, "b": 10, "c": 10}) == ["b", "c", "a"]


def test_candidates_exclude_models_in_use():
    p = fill(LRU(FakeClock(0.0)), {"a": 10, "b": 10, "c": 10})
    # b is in use, so the cache does not offer it: c is next after a.
    assert p.choose_victims(15, {"a": 10, "c": 10}) == ["a", "c"]


def test_not_enough_room_chooses_nobody():
    p = fill(LRU(FakeClock(0.0)), {"a": 10, "b": 10})
    assert p.choose_victims(25, {"a": 10, "b": 10}) == []


def test_lfu_evicts_least_frequently_used_ties_by_recency():
    p = fill(LFU(FakeClock(0.0)), {"a": 10, "b": 10, "c": 10})
    for t in (10, 11, 12):
        at(p, t).accessed("a")
    at(p, 13).accessed("b")
    at(p, 14).accessed("c")
    assert p.choose_victims(10, {"a": 10, "b": 10, "c": 10}) == ["b"]   # b and c used once; b longer ago
    assert p.choose_victims(30, {"a": 10, "b": 10, "c": 10}) == ["b", "c", "a"]


def test_fifo_ignores_popularity():
    p = fill(FIFO(FakeClock(0.0)), {"a": 10, "b": 10, "c": 10})
    for t in range(10, 20):
        at(p, t).accessed("a")
    assert p.choose_victims(10, {"a": 10, "b": 10, "c": 10}) == ["a"]


def test_gdsf_prefers_evicting_big_rarely_used_models():
    p = fill(GDSF(FakeClock(0.0)), {"small": 1 * MiB, "big": 100 * MiB, "mid": 10 * MiB})
    at(p, 10).accessed("big")
    at(p, 11).accessed("mid")
    at(p, 12).accessed("mid")
    # H = L + freq/sizeMiB: small 1/1 = 1, big 1/100, mid 2/10 -> big goes first, small last.
    assert p.choose_victims(1, {"small": MiB, "big": 100 * MiB, "mid": 10 * MiB}) == ["big"]
    assert p.choose_victims(105 * MiB, {"small": MiB, "big": 100 * MiB, "mid": 10 * MiB}) == ["big", "mid"]


def test_gdsf_inflation_ages_out_idle_models():
    p = fill(GDSF(FakeClock(0.0)), {"old": 1 * MiB, "x": 100 * MiB})
    p.removed("x")                      # evicting x raises L to x's priority (0.01)
    at(p, 5).created("new", 1 * MiB)    # new's H = L + 1 > old's H = 1
    assert p.choose_victims(1, {"old": MiB, "new": MiB}) == ["old"]


def test_never_evicts_nothing():
    p = fill(Never(FakeClock(0.0)), {"a": 10})
    assert p.choose_victims(1, {"a": 10}) == []


def test_eager_frees_on_release_and_orders_like_lru():
    p = fill(Eager(FakeClock(0.0)), {"a": 10, "b": 10})
    assert p.evict_on_release and not LRU.evict_on_release
    assert p.choose_victims(10, {"a": 10, "b": 10}) == ["a"]


def test_removed_models_are_forgotten_and_unknown_candidates_ignored():
    p = fill(LRU(FakeClock(0.0)), {"a": 10, "b": 10})
    p.removed("a")
    assert p.choose_victims(10, {"a": 10, "b": 10}) == ["b"]
    assert p.choose_victims(10, {"zzz": 10}) == []


def test_make_policy():
    assert isinstance(make_policy("gdsf", FakeClock(0.0)), GDSF)
    with pytest.raises(ValueError, match="choose one of lru, lfu, fifo, gdsf, never, eager"):
        make_policy("random", FakeClock(0.0))
