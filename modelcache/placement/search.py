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


def place(table: CostTable, system: System, batch: int = 1, objective: str = "latency", seed: int = 0,
          time_budget_s: float = 60.0, tail: float = 0.1, clock=time.monotonic) -> Placement:
    t0 = clock()
    cost = PlanCost(table, system, batch)
    splits = SplitSearch(cost, seed)
    base = B.all_baselines(cost, tail)
    # The GA starts from the baselines too: a search that cannot do worse than what it is compared with.
    ga = GeneticSearch(cost, objective, seed=seed, time_budget_s=time_budget_s * 0.8, seeds=base, splits=splits,
                       clock=clock)
    plan = ga.run()
    notes = [f"GA: {ga.generations_run} generations, {ga.evaluations} plans evaluated"]
    if objective == "latency" and dp_work(table.n, len(system.workers)) <= WORK_LIMIT:
        exact = optimal_latency_plan(cost, splits)
        gap = cost.latency_s(plan) / cost.latency_s(exact) - 1 if cost.latency_s(exact) else 0.0
        notes.append(f"DP optimum {cost.latency_s(exact) * 1e3:.3f} ms; the GA is {gap * 100:.2f} % above it")
        if cost.latency_s(exact) < cost.latency_s(plan):
            plan = exact
    plan.objective, plan.model, plan.system = objective, table.model, system.name
    cost.annotate(plan)
    return Placement(plan, base, cost, clock() - t0, notes)
