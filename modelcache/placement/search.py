"""`place`: the search as a whole — baselines, the GA seeded with them, and the exact DP where it is small."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from . import baselines as B
from .costs import CostTable
from .dp import WORK_LIMIT, dp_work, optimal_latency_plan
from .ga import GeneticSearch
from .plan import Plan, PlanCost
from .split import SplitSearch
from .system import System


@dataclass
class Placement:
    plan: Plan
    baselines: list
    cost: PlanCost
    search_s: float
    notes: list = field(default_factory=list)


def merge_same_sets(cost: PlanCost, plan: Plan, objective: str) -> Plan:
    """Join neighbouring stages on the same worker set where that costs nothing: fewer stages to serve,
    the same schedule (the DP may end a stage and start another on the same set at equal cost)."""
    stages = list(plan.stages)
    k = 0
    while k < len(stages) - 1:
        a, b = stages[k], stages[k + 1]
        if set(a.workers) == set(b.workers):
            splits = SplitSearch(cost)
            joined = splits.stage(a.start, b.end, sum(1 << w for w in a.workers))
            trial = Plan(stages[:k] + [joined] + stages[k + 2:], plan.batch, method=plan.method)
            if cost.score(trial, objective)[0] <= cost.score(Plan(stages, plan.batch), objective)[0] * (1 + 1e-9):
                stages = trial.stages
                continue
        k += 1
    return Plan(stages, plan.batch, method=plan.method)


def place(table: CostTable, system: System, batch: int = 1, objective: str = "latency", seed: int = 0,
          time_budget_s: float = 60.0, tail: float = 0.1, clock=time.monotonic) -> Placement:
    t0 = clock()
    cost = PlanCost(table, system, batch)
    splits = SplitSearch(cost, seed)
    base = B.all_baselines(cost, tail)
    # The GA starts from the baselines too: a search that cannot do worse than what it is compared with.
    ga = GeneticSearch(cost, objective, seed=seed, time_budget_s=time_budget_s * 0.7, seeds=base, splits=splits,
                       clock=clock)
    plan = ga.run()
    notes = [f"GA: {ga.generations_run} generations, {ga.evaluations} plans evaluated"]
    if objective == "latency" and dp_work(table.n, len(system.workers)) <= WORK_LIMIT:
        exact = optimal_latency_plan(cost, splits)
        gap = cost.latency_s(plan) / cost.latency_s(exact) - 1 if cost.latency_s(exact) else 0.0
        notes.append(f"DP optimum {cost.latency_s(exact) * 1e3:.3f} ms; the GA is {gap * 100:.2f} % above it")
        if cost.latency_s(exact) < cost.latency_s(plan):
            plan = exact
    plan = merge_same_sets(cost, plan, objective)
    plan.objective, plan.model, plan.system = objective, table.model, system.name
    cost.annotate(plan)
    return Placement(plan, base, cost, clock() - t0, notes)
