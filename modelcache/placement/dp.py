"""The exact optimum for the chain case with few workers: a dynamic program over stage boundaries and sets.

Latency is a sum over stages of (transfer in + stage time), and a transfer depends only on the
layouts of the two stages it joins, so the best plan whose last stage is nodes [i, j) on set S
extends the best plan ending at i on some set S' with last stage [h, i):

    best[i, j, S] = min over h, S' of best[h, i, S'] + transfer(i, [h, i)S' -> [i, j)S) + time([i, j), S)

Work grows as n³ · 4^W (n nodes, W workers), so it is for small cases: the optimum there, and the
check on the genetic search. Stage splits come from the same inner level the GA uses (split.py).
Memory capacity is checked per stage here and on the whole plan by PlanCost.
"""

from __future__ import annotations

import math

from .plan import Plan, PlanCost
from .split import SplitSearch

WORK_LIMIT = 2e7     # n³ · 4^W above this: too slow for an exact answer here, use the GA


def dp_work(n: int, workers: int) -> float:
    return n ** 3 * 4 ** workers / 6


def optimal_latency_plan(cost: PlanCost, splits: SplitSearch | None = None) -> Plan:
    n, W = cost.table.n, len(cost.kinds)
    if dp_work(n, W) > WORK_LIMIT:
        raise ValueError(f"{n} nodes on {W} workers is too large for the exact program (use the GA)")
    splits = splits or SplitSearch(cost)
    masks = range(1, 1 << W)
    layout = cost._layout
    fits = {}

    def stage(i, j, m):
        s = splits.stage(i, j, m)
        key = (i, j, m)
        if key not in fits:
            fits[key] = all(cost.table.weights(i, j) <= cost.capacity[w] for w, _ in s.active())
        return s if fits[key] else None

    host = layout(None)
    best: dict = {}        # (i, j, mask) -> (latency so far, previous key)
    for j in range(1, n + 1):
        for m in masks:
            s = stage(0, j, m)
            if s is not None:
                best[(0, j, m)] = (cost.transfer_s(0, host, layout(s)) + cost.stage_s(s), None)
    for i in range(1, n):
        ending = [(key, v[0]) for key, v in best.items() if key[1] == i]
        if not ending:
            continue
        for j in range(i + 1, n + 1):
            for m in masks:
                s = stage(i, j, m)
                if s is None:
                    continue
                here = layout(s)
                run = cost.stage_s(s)
                choice = min(((t + cost.transfer_s(i, layout(splits.stage(*k)), here) + run, k) for k, t in ending),
                             default=None)
                if choice is not None:
                    best[(i, j, m)] = choice
    finals = [(t + cost.transfer_s(n, layout(splits.stage(*k)), host), k) for k, (t, _) in best.items() if k[1] == n]
    if not finals:
        raise ValueError("no plan fits the workers' memory")
    total, key = min(finals)
    stages = []
    while key is not None:
        stages.append(splits.stage(*key))
        key = best[key][1]
    plan = Plan(stages[::-1], cost.batch, method="dp")
    plan.latency_s = total if math.isfinite(total) else math.inf
    return plan
