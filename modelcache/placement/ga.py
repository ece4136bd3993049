"""The outer level of the two-level genetic search (MARS): which worker set runs which contiguous run of nodes.

A genome gives every node (in topological order) a worker set, as a bit mask; maximal runs of
equal sets are the stages, so boundaries and sets evolve together and any number of stages can
appear. Each stage's batch split comes from the inner level (split.py). Operators work on runs:
move a boundary, change a run's set, split a run, merge it into a neighbour; crossover is
two-point over the node array. The best genome is polished at the end by hill climbing over the
same moves, exhaustively, until none improves it.

Deterministic for a seed as long as the time budget does not cut the search short.
"""

from __future__ import annotations

import random
import time

from .plan import Plan, PlanCost
from .split import SplitSearch

POLISHED = 6     # genomes of the final population polished by hill climbing


def runs_of(genome: tuple) -> list:
    """[(start, end, mask)] of the maximal runs of equal masks."""
    runs, start = [], 0
    for i in range(1, len(genome) + 1):
        if i == len(genome) or genome[i] != genome[start]:
            runs.append((start, i, genome[start]))
            start = i
    return runs


def genome_of(plan: Plan, n: int) -> tuple:
    genome = [0] * n
    for s in plan.stages:
        mask = sum(1 << w for w, _ in s.active()) or sum(1 << w for w in s.workers)
        genome[s.start:s.end] = [mask] * (s.end - s.start)
    return tuple(genome)


class GeneticSearch:
    def __init__(self, cost: PlanCost, objective: str = "latency", seed: int = 0, population: int = 48,
                 generations: int = 300, stall_generations: int = 60, time_budget_s: float = 60.0,
                 seeds: list | None = None, splits: SplitSearch | None = None, clock=time.monotonic):
        if objective not in ("latency", "throughput"):
            raise ValueError(f"objective {objective!r}: choose latency or throughput")
        self.cost, self.objective = cost, objective
        self.rng = random.Random(seed)
        self.population, self.generations, self.stall = population, generations, stall_generations
        self.time_budget_s, self.clock = time_budget_s, clock
        self.splits = splits or SplitSearch(cost, seed)
        self.n, self.W = cost.table.n, len(cost.kinds)
        self.seeds = [genome_of(p, self.n) for p in seeds or []]
        self._scores: dict = {}
        self.evaluations = 0
        self.generations_run = 0

    # -- genomes ---------------------------------------------------------------------------
    def decode(self, genome: tuple) -> Plan:
        return Plan([self.splits.stage(i, j, m) for i, j, m in runs_of(genome)], self.cost.batch, method="ga")

    def score(self, genome: tuple) -> tuple:
        s = self._scores.get(genome)
        if s is None:
            self.evaluations += 1
            s = self._scores[genome] = self.cost.score(self.decode(genome), self.objective)
        return s

    def _random_mask(self) -> int:
        groups = self.cost.system.groups()
        r = self.rng.random()
        if r < 0.35:
            return 1 << self.rng.randrange(self.W)
        if r < 0.6 and groups:
            return sum(1 << w for w in self.rng.choice(groups))
        return self.rng.randrange(1, 1 << self.W)

    def random_genome(self) -> tuple:
        k = self.rng.randint(1, min(self.n, 4))
        cuts = sorted(self.rng.sample(range(1, self.n), k - 1)) if k > 1 else []
        genome = []
        for a, b in zip([0, *cuts], [*cuts, self.n]):
            genome += [self._random_mask()] * (b - a)
        return tuple(genome)

    def starting_genomes(self) -> list:
        full = (1 << self.W) - 1
        start = [tuple([1 << w] * self.n) for w in range(self.W)] + [tuple([full] * self.n)]
        start += [tuple([sum(1 << w for w in g)] * self.n) for g in self.cost.system.groups()]
        start += self.seeds
        return list(dict.fromkeys(start))

    def mutate(self, genome: tuple) -> tuple:
        g = list(genome)
        runs = runs_of(genome)
        op = self.rng.random()
        if op < 0.3 and len(runs) > 1:                       # move a boundary
            r = self.rng.randrange(len(runs) - 1)
            (a, _, m1), (_, d, m2) = runs[r], runs[r + 1]
            p = self.rng.randint(a + 1, d - 1) if d - a > 1 else a + 1
            g[a:p], g[p:d] = [m1] * (p - a), [m2] * (d - p)
        elif op < 0.6:                                       # change a run's set
            a, b, m = self.rng.choice(runs)
            new = m ^ (1 << self.rng.randrange(self.W)) if self.rng.random() < 0.5 else self._random_mask()
            g[a:b] = [new or m] * (b - a)
        elif op < 0.7:                                       # one node to another set (a stage of its own)
            i = self.rng.randrange(self.n)
            g[i] = self._random_mask()
        elif op < 0.85:                                      # split a run
            a, b, m = self.rng.choice(runs)
            if b - a > 1:
                p = self.rng.randint(a + 1, b - 1)
                g[p:b] = [self._random_mask()] * (b - p)
        elif len(runs) > 1:                                  # merge a run into a neighbour
            r = self.rng.randrange(len(runs))
            a, b, _ = runs[r]
            other = runs[r - 1][2] if r > 0 and (r == len(runs) - 1 or self.rng.random() < 0.5) else runs[r + 1][2]
            g[a:b] = [other] * (b - a)
        return tuple(g)

    def crossover(self, a: tuple, b: tuple) -> tuple:
        p, q = sorted(self.rng.sample(range(self.n + 1), 2)) if self.n > 1 else (0, 0)
        return a[:p] + b[p:q] + a[q:]

    def neighbours(self, genome: tuple):
        """Every single move: each boundary to each position between its runs' outer ends, each run to
        each other set, each run merged into either neighbour."""
        runs = runs_of(genome)
        for r in range(len(runs) - 1):
            (a, c, m1), (_, d, m2) = runs[r], runs[r + 1]
            for p in range(a + 1, d):
                if p != c:
                    yield genome[:a] + (m1,) * (p - a) + (m2,) * (d - p) + genome[d:]
        for a, b, m in runs:
            for new in range(1, 1 << self.W):
                if new != m:
                    yield genome[:a] + (new,) * (b - a) + genome[b:]
            if b - a > 1:    # a run split in two, the second half on each other set; one node of it moved
                p = (a + b) // 2
                for new in range(1, 1 << self.W):
                    if new != m:
                        yield genome[:p] + (new,) * (b - p) + genome[b:]
        for i in range(self.n):
            for new in range(1, 1 << self.W):
                if new != genome[i]:
                    yield genome[:i] + (new,) + genome[i + 1:]

    def polish(self, genome: tuple, deadline: float) -> tuple:
        best, best_score = genome, self.score(genome)
        improved = True
        while improved and self.clock() < deadline:
            improved = False
            for count, g in enumerate(self.neighbours(best)):
                if count % 64 == 63 and self.clock() > deadline:
                    break
                s = self.score(g)
                if s < best_score:
                    best, best_score, improved = g, s, True
                    break
        return best

    # -- the search ------------------------------------------------------------------------
    def run(self) -> Plan:
        deadline = self.clock() + self.time_budget_s
        pop = self.starting_genomes()
        while len(pop) < self.population:
            pop.append(self.random_genome())
        pop = sorted(dict.fromkeys(pop), key=self.score)[: self.population]
        best_score, stalled = self.score(pop[0]), 0
        elite = max(2, self.population // 8)
        for gen in range(self.generations):
            if self.clock() > deadline:
                break
            self.generations_run = gen + 1
            children = []
            while len(children) < self.population:
                a = min(self.rng.sample(pop, 3), key=self.score)      # tournaments of three
                b = min(self.rng.sample(pop, 3), key=self.score)
                child = self.crossover(a, b) if self.rng.random() < 0.6 else a
                for _ in range(1 + (self.rng.random() < 0.3)):
                    child = self.mutate(child)
                children.append(child)
            pop = sorted(dict.fromkeys(pop[:elite] + children + pop[elite:]), key=self.score)[: self.population]
            if self.score(pop[0]) < best_score:
                best_score, stalled = self.score(pop[0]), 0
            else:
                stalled += 1
                if stalled >= self.stall:
                    break
        # Hill-climb from the few best: they often sit in different basins, and the climb is cheap.
        polish_until = deadline + 0.2 * self.time_budget_s
        best = min((self.polish(g, polish_until) for g in pop[:POLISHED]), key=self.score)
        plan = self.decode(best)
        plan.objective = self.objective
        return plan
