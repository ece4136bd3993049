"""The inner level of the search: how a stage's batch is split across the workers of its set.

MARS splits a layer across the accelerators of its set; here the batch's rows are split. The split
of a stage minimizes its slowest worker (then the workers' total time, which frees resources for a
pipeline). Small cases are enumerated exactly; larger ones run a small genetic search seeded with
the water-filling split (each row to the worker that would finish it first) and the even split.
Every answer is cached per (nodes, set): the outer searches and the DP ask the same ones often.
"""

from __future__ import annotations

import itertools
import random

from .plan import PlanCost, Stage, even_split

EXACT_LIMIT = 400        # compositions enumerated exactly below this many
INNER_POPULATION = 16
INNER_GENERATIONS = 24


def _compositions(total: int, parts: int):
    for bars in itertools.combinations(range(total + parts - 1), parts - 1):
        prev, out = -1, []
        for b in bars:
            out.append(b - prev - 1)
            prev = b
        out.append(total + parts - 1 - prev - 1)
        yield tuple(out)


def _count(total: int, parts: int) -> int:
    from math import comb
    return comb(total + parts - 1, parts - 1)


class SplitSearch:
    def __init__(self, cost: PlanCost, seed: int = 0):
        self.cost, self.seed = cost, seed
        self._cache: dict = {}

    def members(self, mask: int) -> tuple:
        return tuple(w for w in range(len(self.cost.kinds)) if mask >> w & 1)

    def stage(self, i: int, j: int, mask: int) -> Stage:
        key = (i, j, mask)
        s = self._cache.get(key)
        if s is None:
            workers = self.members(mask)
            split = self.best_split(i, j, workers)
            # Workers given no rows are left out: the stage runs without them, and serving would let dmda
            # pick them (for other requests) though the plan never costed them.
            active = [(w, b) for w, b in zip(workers, split) if b > 0]
            s = self._cache[key] = Stage(i, j, tuple(w for w, _ in active), tuple(b for _, b in active))
        return s

    def best_split(self, i: int, j: int, workers: tuple) -> tuple:
        """Rows per worker. Workers of one kind are interchangeable, and for equal workers the slowest is
        fastest when their rows are balanced; so the search is over rows per kind, each kind's rows spread
        evenly over its workers: exact when that space is small, else the genetic search."""
        batch, cost = self.cost.batch, self.cost
        if len(workers) == 1:
            return (batch,)
        kinds = list(dict.fromkeys(cost.kinds[w] for w in workers))
        members = [[k for k, w in enumerate(workers) if cost.kinds[w] == kind] for kind in kinds]
        # time of one worker of each kind at b rows, b = 0..batch
        times = [[cost.worker_s(workers[m[0]], i, j, b) for b in range(batch + 1)] for m in members]

        def expand(per_kind) -> tuple:
            split = [0] * len(workers)
            for rows, m in zip(per_kind, members):
                for k, r in zip(m, even_split(rows, len(m))):
                    split[k] = r
            return tuple(split)

        def fit(per_kind) -> tuple:
            spread = [(times[k][r // len(m) + (1 if r % len(m) else 0)], times[k][r // len(m)], r % len(m), len(m))
                      for k, (r, m) in enumerate(zip(per_kind, members))]
            slowest = max(t_hi if rem else t_lo for t_hi, t_lo, rem, _ in spread)
            total = sum(rem * t_hi + (n - rem) * t_lo for t_hi, t_lo, rem, n in spread)
            return (slowest, total)

        if len(kinds) == 1:
            return expand((batch,))
        if _count(batch, len(kinds)) <= EXACT_LIMIT:
            return expand(min(_compositions(batch, len(kinds)), key=fit))
        return expand(self._genetic(batch, len(kinds), fit, (i, j, workers)))

    def _genetic(self, batch: int, parts: int, fit, key) -> tuple:
        """Rows per kind by a small genetic search, seeded with the even split; deterministic per stage."""
        rng = random.Random(hash((self.seed, *key)))
        scores: dict = {}

        def score(c):
            s = scores.get(c)
            if s is None:
                s = scores[c] = fit(c)
            return s
        pop = {even_split(batch, parts)}
        while len(pop) < INNER_POPULATION:
            cut = sorted(rng.randint(0, batch) for _ in range(parts - 1))
            pop.add(tuple(b - a for a, b in zip([0, *cut], [*cut, batch])))
        pop = sorted(pop, key=score)
        for _ in range(INNER_GENERATIONS):
            children = []
            for _ in range(INNER_POPULATION):
                a, b = rng.sample(pop[: max(2, len(pop) // 2)], 2)
                child = [x if rng.random() < 0.5 else y for x, y in zip(a, b)]
                while sum(child) != batch:    # repair: rows added or taken at random kinds
                    k = rng.randrange(len(child))
                    if sum(child) < batch:
                        child[k] += 1
                    elif child[k] > 0:
                        child[k] -= 1
                if rng.random() < 0.7:        # mutation: move some rows from one kind to another
                    src, dst = rng.sample(range(len(child)), 2)
                    n = rng.randint(0, child[src])
                    child[src] -= n
                    child[dst] += n
                children.append(tuple(child))
            pop = sorted(set(pop) | set(children), key=score)[:INNER_POPULATION]
        return pop[0]
