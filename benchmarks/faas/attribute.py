"""Why each cold start happened and where memory-time went idle: the replay of simulate.py, instrumented,
for one policy at some capacities. What benchmarks/faas/README.md's "where hybrid's cold starts come
from" is measured with.

    python -m benchmarks.faas.attribute --hours 6 --seed 0 --policy hybrid --capacities 0.1,0.3,1

A cold call's cause is why its model was not resident when it came: its function's first call; the
model on its way up for an earlier call; evicted under pressure; unloaded by the policy's timer with a
pre-warm still pending (the call came before the pre-warm, or the pre-warm found no room), or with none
(the call came after the keep-alive window); "pre-warmed, ..." when what was freed was a pre-warm no call
had used. Idle memory-time is what a model held from its last call's arrival or its load, whichever came
later, until it was freed, by the same causes; kept memory-time is what it held from there until a warm
call, by the length of that gap (what keeping it bought). Functions are "timer" (their trigger), "rare"
(at most one call an hour on average over the replayed window) or "other" (bursty, busy).
"""

from __future__ import annotations

import sys
from collections import Counter

from modelcache.daemon.residency import ModelState
from modelcache.daemon.residency import Residency
from modelcache.usage import Parser

from benchmarks.faas.simulate import GIB, Costs, Replay, trace_policy
from benchmarks.faas.sweep import load_trace, trace_arguments
from benchmarks.faas.trace import FunctionCounts


def function_classes(functions: list[FunctionCounts], models: dict[str, tuple[str, int]], calls: list,
                     hours: float) -> dict[str, str]:
    """Each model's function's class (module docstring), from the calls replayed over `hours` of trace."""
    n = Counter(c.function for c in calls)
    return {models[f.id][0]: "timer" if f.trigger == "timer" else "rare" if n[f.id] <= hours else "other"
            for f in functions}


GAPS = ((60.0, "< 1 min"), (600.0, "1-10 min"), (3600.0, "10-60 min"), (float("inf"), "> 1 hour"))


class ObservedResidency(Residency):
    """The residency manager, telling `freeing(model, counter)` of each copy it is about to free, and why."""

    freeing = None

    def evict(self, model, counter: str = "evictions") -> int:
        self.freeing(model, counter)
        return super().evict(model, counter)


class AttributedReplay(Replay):
    """A `Replay` that also counts cold calls and idle memory-time by (function class, cause)."""

    def __init__(self, make_policy, capacity_bytes: int, sizes: dict[str, int], classes: dict[str, str],
                 costs: Costs = Costs()):
        super().__init__(make_policy, capacity_bytes, sizes, costs, residency=ObservedResidency)
        self.residency.freeing = self._freeing
        self.capacity = capacity_bytes
        self.classes = classes
        self.cold: Counter = Counter()
        self.idle_gib_s: Counter = Counter()
        self.kept_gib_s: Counter = Counter()
        self.kept_calls: Counter = Counter()
        self._freed_because: dict[str, str] = {}
        self._idle_since: dict[str, float] = {}   # the last call's arrival, or the load

    def _arrive(self, inv) -> None:
        m = self.models[inv.model]
        state, size = m.host.state, self.tier.sizes[m.key]
        if state is not ModelState.RESIDENT and size <= self.capacity:
            cause = ("first call" if inv.model not in self._idle_since and inv.model not in self._freed_because
                     else "on its way up" if state in (ModelState.WAITING, ModelState.LOADING)
                     else self._freed_because[inv.model])
            self.cold[(self.classes.get(inv.model, "other"), cause)] += 1
        elif state is ModelState.RESIDENT and inv.model in self._idle_since:
            gap = self.now - self._idle_since[inv.model]
            key = (self.classes.get(inv.model, "other"), next(b for limit, b in GAPS if gap < limit))
            self.kept_gib_s[key] += size * gap / GIB
            self.kept_calls[key] += 1
        self._idle_since[inv.model] = self.now
        super()._arrive(inv)

    def _loaded(self, key: str) -> None:
        name = self.registry.by_key(key).name
        self._idle_since[name] = max(self._idle_since.get(name, self.now), self.now)

    def _freeing(self, model, counter: str) -> None:
        if counter == "unloads":
            pending = model.key in getattr(self.residency.policy, "prewarm_at", {})
            cause = "unloaded, pre-warm pending" if pending else "unloaded after its window"
        else:
            cause = "evicted"
        if model.host.prewarmed:
            cause = "pre-warmed, " + cause
        self._freed_because[model.name] = cause
        idle_s = self.now - self._idle_since.get(model.name, self.now)
        self.idle_gib_s[(self.classes.get(model.name, "other"), cause)] += self.tier.placed[model.key] * idle_s / GIB


def report(r: AttributedReplay) -> str:
    res = r.result
    lines = [f"{res.policy} at {res.capacity_bytes / GIB:.2f} GiB: {res.disk_misses} cold of {res.calls} calls "
             f"({res.cold_fraction:.3%}), {res.gib_s:.0f} GiB*s, {res.prewarms} pre-warms "
             f"({res.wasted_prewarms} wasted)",
             "  cold calls by function class and cause:"]
    lines += [f"    {n:7d}  {cls:6s} {cause}" for (cls, cause), n in r.cold.most_common()]
    lines.append(f"  idle memory-time until freed, GiB*s ({sum(r.idle_gib_s.values()):.0f} in all):")
    lines += [f"    {v:7.0f}  {cls:6s} {cause}" for (cls, cause), v in r.idle_gib_s.most_common()]
    lines.append(f"  kept memory-time until a warm call, GiB*s ({sum(r.kept_gib_s.values()):.0f} in all), by the gap:")
    lines += [f"    {v:7.0f}  {cls:6s} {gap:9s} {r.kept_calls[(cls, gap)]:7d} calls"
              for (cls, gap), v in r.kept_gib_s.most_common()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = Parser(prog="python -m benchmarks.faas.attribute", description=__doc__.split("\n\n")[0])
    trace_arguments(ap)
    ap.add_argument("--policy", default="hybrid", help="the eviction policy to replay")
    args = ap.parse_args(argv)
    _, functions, models, sizes, calls = load_trace(ap, args, None)
    hours = (calls[-1].t if calls else 0.0) * args.compress / 3600   # of trace time
    classes = function_classes(functions, models, calls, max(hours, 1.0))
    total = sum(sizes.values())
    for frac in (float(x) for x in args.capacities.split(",")):
        r = AttributedReplay(trace_policy(args.policy, args.compress), int(total * frac), sizes, classes)
        r.run(calls)
        print(report(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
