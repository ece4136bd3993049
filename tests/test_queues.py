"""A model's queue by priority level (executor/queues.py), pure: requests are plain records, `now` is handed in."""

from __future__ import annotations

import pytest

from modelcache.calibration import check_serving
from modelcache.executor.queues import ModelQueue, Refused


class Req:
    def __init__(self, tag):
        self.tag = tag

    def __repr__(self):
        return f"Req({self.tag})"


def tags(queue):
    return [r.tag for r in queue]


def fill(queue, now, *pairs):
    """(tag, priority) pairs, queued at `now`; the records, by tag."""
    made = {}
    for tag, priority in pairs:
        made[tag] = Req(tag)
        queue.append(made[tag], priority, now)
    return made


def test_without_levels_it_is_one_fifo_queue_and_priorities_are_ignored():
    q = ModelQueue(None)
    fill(q, 0.0, ("a", None), ("b", 1), ("c", 7))
    assert tags(q) == ["a", "b", "c"] and q.head.tag == "a" and len(q) == 3
    assert {r.queue_level for r in q} == {0}


def test_levels_are_served_lowest_first_and_each_in_arrival_order():
    serving = {"priority_levels": 3, "default_priority": 2}
    check_serving(serving)
    q = ModelQueue(serving)
    fill(q, 0.0, ("a", None), ("b", 3), ("c", 1), ("d", 0), ("e", 9), ("f", 1))
    # 0, None and a level above the three: the default level, 2 (Triton's SetPriority)
    assert tags(q) == ["c", "f", "a", "d", "e", "b"]
    assert q.depths() == {"1": 2, "2": 3, "3": 1}
    assert [q.popleft().tag for _ in range(3)] == ["c", "f", "a"]
    assert q.head.tag == "d" and len(q) == 3


def test_a_request_put_back_goes_where_it_was():
    q = ModelQueue({"priority_levels": 2, "default_priority": 2})
    fill(q, 0.0, ("low1", 2), ("hi", 1), ("low2", 2))
    taken = [q.popleft(), q.popleft()]          # hi, low1
    for r in reversed(taken):                   # a batch shrunk from its end gives its members back
        q.appendleft(r)
    assert tags(q) == ["hi", "low1", "low2"]
    q.remove(next(r for r in q if r.tag == "low1"))
    assert tags(q) == ["hi", "low2"]


def test_each_level_has_its_own_bound_and_the_daemons_bounds_the_rest():
    q = ModelQueue({"priority_levels": 2, "default_priority": 2, "priority_queues": {"1": {"max_queue": 1}}})
    fill(q, 0.0, ("h1", 1))
    with pytest.raises(Refused, match=r"Exceeds maximum queue size \(1\) of priority level 1"):
        q.append(Req("h2"), 1, 0.0)
    for i in range(3):                          # level 2 has no bound of its own: the daemon's bounds the whole queue
        q.append(Req(f"l{i}"), 2, 0.0, max_queue=4)
    with pytest.raises(Refused, match=r"Exceeds maximum queue size \(4\)$"):
        q.append(Req("l3"), 2, 0.0, max_queue=4)
    assert tags(q) == ["h1", "l0", "l1", "l2"]
    q.popleft()
    q.append(Req("h2"), 1, 0.0)                 # room again at level 1
    assert tags(q)[0] == "h2"


def test_a_queue_timeout_refuses_with_reject_and_moves_behind_with_delay():
    serving = {"priority_levels": 2, "default_priority": 2, "queue_timeout_ms": 10.0,
               "priority_queues": {"2": {"queue_timeout_ms": 5.0, "queue_delay": True}}}
    check_serving(serving)
    q = ModelQueue(serving)
    fill(q, 0.0, ("h_old", 1), ("l_old", 2))
    fill(q, 0.004, ("h_new", 1), ("l_new", 2))
    assert q.next_due() == 0.005                # level 2's first waiting request: 0 + 5 ms
    assert q.expire(0.005) == []                # due, not yet past
    assert q.expire(0.0051) == [] and tags(q) == ["h_old", "h_new", "l_new", "l_old"]   # l_old delayed
    assert q.next_due() == pytest.approx(0.009)  # l_new; the delayed one waits on without a timeout
    assert [r.tag for r in q.expire(0.0101)] == ["h_old"]   # level 1 rejects; l_new moves behind l_old
    assert tags(q) == ["h_new", "l_old", "l_new"]
    assert all(r.queue_deadline is None for r in q if r.tag.startswith("l"))
    taken = q.popleft(), q.popleft()            # h_new, then the delayed l_old
    assert [r.tag for r in taken] == ["h_new", "l_old"] and taken[1].delayed
    q.appendleft(taken[1])                      # put back among the delayed, ahead of them
    assert tags(q) == ["l_old", "l_new"] and q.next_due() is None


def test_a_reconfigured_queue_keeps_its_requests_and_takes_new_bounds():
    q = ModelQueue({"max_queue": 1})
    fill(q, 0.0, ("a", None))
    with pytest.raises(Refused):
        q.append(Req("b"), None, 0.0)
    q.configure({"max_queue": 2})
    q.append(Req("b"), None, 0.0)
    assert tags(q) == ["a", "b"]


@pytest.mark.parametrize("serving, words", [
    ({"priority_levels": 2, "default_priority": 3}, r"default priority level must be in range \[1, 2\]"),
    ({"priority_levels": 2, "default_priority": 0}, r"default priority level must be in range \[1, 2\]"),
    ({"priority_levels": -1}, "priority_levels must be a whole number"),
    ({"priority_levels": 2, "priority_queues": {"3": {}}}, r"priority level in range \[1, 2\]: not '3'"),
    ({"priority_levels": 2, "priority_queues": {"1": {"max_batch": 3}}}, r"priority_queues\[1\] must be a map of"),
    ({"priority_levels": 2, "priority_queues": {"1": {"queue_timeout_ms": -1}}},
     r"priority_queues\[1\]\.queue_timeout_ms must be"),
    ({"default_priority": 1}, "need priority_levels"),
    ({"queue_delay": "yes"}, "queue_delay must be true or false"),
])
def test_check_serving_refuses_bad_priority_fields(serving, words):
    with pytest.raises(ValueError, match=words):
        check_serving(serving)
