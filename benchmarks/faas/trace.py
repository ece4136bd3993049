"""The Azure Functions 2019 invocation-count format: read it, give each function a model, and turn the
per-minute counts into invocation events in time order.

A row per function: `HashOwner,HashApp,HashFunction,Trigger,1,2,...,1440` — invocations in each minute
of a day (column 1 is the first minute). The samples in vhive-serverless/invitro reorder the hash
columns, drop `Trigger`, start at a later minute (`540,541,...`) or name the minutes `minute_N`; all read
the same here. Columns that are neither (`start_timestamp`) are ignored.
"""

from __future__ import annotations

import csv
import random
import re
from dataclasses import dataclass
from pathlib import Path

MINUTE_S = 60.0
HASHES = ("HashOwner", "HashApp", "HashFunction")
_MINUTE = re.compile(r"^(?:minute_)?(\d+)$")


@dataclass(frozen=True)
class FunctionCounts:
    owner: str
    app: str
    function: str
    trigger: str
    first_minute: int           # the trace's number of the first count (1: the day's first minute)
    counts: tuple[int, ...]     # invocations per minute from there

    @property
    def id(self) -> str:
        return f"{self.app}/{self.function}"


@dataclass(frozen=True, order=True)
class Invocation:
    t: float          # seconds from the start of the replayed window, compressed
    function: str
    model: str


def read_counts(path: str | Path, minutes: tuple[int, int] | None = None) -> list[FunctionCounts]:
    """Every function row of an invocation-count CSV, in file order.

    A file whose minute columns have a gap (a slice cut from two places of the day) is read only with a
    window, `minutes` = (first, stop) in the trace's numbers, inside one consecutive run: counts are never
    laid across minutes the file does not have."""
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            raise ValueError(f"{path}: empty file; expected the Azure Functions header "
                             "HashOwner,HashApp,HashFunction,Trigger,1,2,...")
        where = {name.strip(): i for i, name in enumerate(header)}
        missing = [h for h in HASHES if h not in where]
        columns = [(int(m.group(1)), i) for i, name in enumerate(header) if (m := _MINUTE.match(name.strip()))]
        if missing or not columns:
            raise ValueError(f"{path}: not an invocation-count trace (missing "
                             f"{', '.join(missing) or 'minute columns'}); expected the Azure Functions header "
                             "HashOwner,HashApp,HashFunction,Trigger,1,2,... or minute_N columns")
        columns = _one_run(path, sorted(columns), minutes)
        first = columns[0][0]
        trigger = where.get("Trigger")
        out = []
        for line, row in enumerate(rows, start=2):
            if not row:
                continue
            try:
                counts = tuple(int(float(row[i])) if row[i].strip() not in ("", "nan") else 0 for _, i in columns)
            except (ValueError, IndexError) as e:
                raise ValueError(f"{path}:{line}: a minute count is not a number or is missing ({e})") from None
            out.append(FunctionCounts(row[where["HashOwner"]], row[where["HashApp"]], row[where["HashFunction"]],
                                      row[trigger] if trigger is not None else "", first, counts))
        return out


def _one_run(path, columns: list[tuple[int, int]], window: tuple[int, int] | None) -> list[tuple[int, int]]:
    """The (minute, column) pairs of the consecutive run of minutes to read: all of them when there is no
    gap, else the run that holds `window`."""
    runs = [[columns[0]]]
    for c in columns[1:]:
        if c[0] == runs[-1][-1][0] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    if len(runs) == 1:
        return columns
    named = ", ".join(f"{r[0][0]}-{r[-1][0]}" for r in runs)
    if window is not None:
        for r in runs:
            if r[0][0] <= window[0] and window[1] <= r[-1][0] + 1:
                return r
    longest = max(runs, key=len)
    raise ValueError(f"{path}: the minute columns are not consecutive (runs {named}); replay one run with a "
                     f"window inside it, e.g. --minutes {longest[0][0]}:{longest[-1][0] + 1}")


def write_counts(path: str | Path, functions: list[FunctionCounts], minute_names: bool = False) -> None:
    """Write rows in the Azure Functions format (`minute_N` column names with `minute_names`)."""
    first = min(f.first_minute for f in functions)
    length = max(f.first_minute + len(f.counts) for f in functions) - first
    names = [f"minute_{m}" if minute_names else str(m) for m in range(first, first + length)]
    with open(path, "w", newline="") as out:
        w = csv.writer(out)
        w.writerow([*HASHES, "Trigger", *names])
        for f in functions:
            counts = [0] * length
            counts[f.first_minute - first: f.first_minute - first + len(f.counts)] = f.counts
            w.writerow([f.owner, f.app, f.function, f.trigger, *counts])


def assign_models(functions: list[FunctionCounts], catalogue: list[tuple[str, int]], seed: int = 0,
                  shared: bool = False) -> dict[str, tuple[str, int]]:
    """Each function's model (name, size in bytes), fixed for the run, drawn from `catalogue` with `seed`.

    Not `shared` (the default): each function gets its own copy of the drawn architecture, named
    `name#i` — its own fine-tuned weights, as each FaaS function has its own code. `shared`: functions
    that draw the same entry call the same model."""
    if not catalogue:
        raise ValueError("no models to map functions to: the catalogue is empty")
    rng = random.Random(seed)
    out = {}
    for i, f in enumerate(functions):
        name, size = catalogue[rng.randrange(len(catalogue))]
        out[f.id] = (name if shared else f"{name}#{i}", size)
    return out


def invocations(functions: list[FunctionCounts], models: dict[str, tuple[str, int]], seed: int = 0,
                compress: float = 1.0, minutes: tuple[int, int] | None = None) -> list[Invocation]:
    """The invocations of the trace in time order: each minute's count spread uniformly at random
    (`seed`) inside its minute, time measured from the window's start and divided by `compress`.

    `minutes` = (first, stop): replay only the trace's minutes first <= m < stop (the trace's numbers)."""
    if compress <= 0:
        raise ValueError(f"compress must be positive (got {compress}): 60 replays an hour in a minute")
    rng = random.Random(seed)
    start = minutes[0] if minutes else min(f.first_minute for f in functions)
    stop = minutes[1] if minutes else None
    out = []
    for f in functions:
        model = models[f.id][0]
        for j, count in enumerate(f.counts):
            m = f.first_minute + j
            if count <= 0 or m < start or (stop is not None and m >= stop):
                continue
            base = (m - start) * MINUTE_S
            out.extend(Invocation((base + rng.random() * MINUTE_S) / compress, f.id, model) for _ in range(count))
    out.sort()
    return out


def zoo_catalogue() -> list[tuple[str, int]]:
    """The zoo's published architectures with their weights' size (fp32: 4 bytes a parameter, fp16: 2)."""
    from modelcache.zoo import ZOO
    return [(name, p * (2 if name.endswith("fp16") else 4)) for name, e in ZOO.items()
            if (p := e.published_params) is not None]
