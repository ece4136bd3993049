"""The plans a search is compared against, each as its authors would place the model.

- half-split (MARS's baseline): the first half of the nodes on the first worker group, the second half
  on the second, each group splitting the batch evenly.
- tail fraction (StarONNX): the head on the fastest worker, the last `tail` share of its compute on the
  fastest worker of another kind (StarONNX offloads 5-15 % of GPU time to the CPU).
- fastest single worker: the whole model on the worker that runs it soonest.
- greedy by speed: each node on the worker fastest for it alone, transfers ignored (a list scheduler's
  choice); consecutive nodes on one worker form a stage.
"""

from __future__ import annotations

from .plan import Plan, PlanCost, Stage, even_split


def _whole_s(cost: PlanCost, w: int) -> float:
    return cost.worker_s(w, 0, cost.table.n, cost.batch)


def fastest_single(cost: PlanCost) -> Plan:
    w = min(range(len(cost.kinds)), key=lambda w: (_whole_s(cost, w), w))
    return Plan([Stage(0, cost.table.n, (w,), (cost.batch,))], cost.batch, method="fastest single worker")


def _nearest_boundary(cum: list, share: float) -> int:
    """The boundary 1..n-1 whose cumulative share of cost is nearest `share`."""
    total = cum[-1] or 1.0
    return min(range(1, len(cum) - 1), key=lambda i: (abs(cum[i] / total - share), i))


def half_split(cost: PlanCost) -> Plan:
    n = cost.table.n
    groups = cost.system.groups()
    if len(groups) < 2:   # one group: halve it
        ws = groups[0]
        groups = [ws[: max(1, len(ws) // 2)], ws[max(1, len(ws) // 2):] or ws]
    first, second = groups[0], groups[1]
    mid = max(1, n // 2)
    if n == 1:
        return Plan([Stage(0, 1, tuple(first), even_split(cost.batch, len(first)))], cost.batch, method="half-split")
    return Plan([Stage(0, mid, tuple(first), even_split(cost.batch, len(first))),
                 Stage(mid, n, tuple(second), even_split(cost.batch, len(second)))], cost.batch, method="half-split")


def tail_fraction(cost: PlanCost, tail: float = 0.1) -> Plan:
    n = cost.table.n
    order = sorted(range(len(cost.kinds)), key=lambda w: (_whole_s(cost, w), w))
    head = order[0]
    other = next((w for w in order if cost.kinds[w] != cost.kinds[head]), order[1] if len(order) > 1 else None)
    if other is None or n < 2:
        plan = fastest_single(cost)
        plan.method = "tail fraction"
        return plan
    kind = cost.kinds[head]
    cum = [cost.table.seconds(kind, 0, i, 1) for i in range(n + 1)]
    cut = _nearest_boundary(cum, 1.0 - tail)
    return Plan([Stage(0, cut, (head,), (cost.batch,)), Stage(cut, n, (other,), (cost.batch,))], cost.batch,
                method=f"tail fraction {tail:g}")


def greedy_by_speed(cost: PlanCost) -> Plan:
    n, W = cost.table.n, len(cost.kinds)
    choice = [min(range(W), key=lambda w: (cost.worker_s(w, i, i + 1, cost.batch), w)) for i in range(n)]
    stages, start = [], 0
    for i in range(1, n + 1):
        if i == n or choice[i] != choice[start]:
            stages.append(Stage(start, i, (choice[start],), (cost.batch,)))
            start = i
    return Plan(stages, cost.batch, method="greedy by speed")


def all_baselines(cost: PlanCost, tail: float = 0.1) -> list[Plan]:
    return [cost.annotate(p) for p in (half_split(cost), tail_fraction(cost, tail), fastest_single(cost),
                                       greedy_by_speed(cost))]
