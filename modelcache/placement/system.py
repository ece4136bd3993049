"""The system description a placement is searched for: worker kinds and their peak rates, workers, links.

A `system.toml` names:

    [kinds.NAME]        peak rates of one kind of worker, for the roofline model of kinds not measured
                        here: conv_gflop_s, matmul_gflop_s, other_gflop_s, mem_gbyte_s, launch_us
    [[workers]]         name, kind, memory_node ("host" for CPU groups), memory_gbyte, group (optional)
    [[links]]           nodes = [A, B, ...] (every pair of them is linked), gbit_per_s, latency_us
    request_us          (top level, optional) what serving adds to a request outside its stages: the
                        client's encode and decode, the round trip to the daemon (default 0)
    handoff_us          (top level, optional) what serving adds per stage outside its run: the daemon
                        posting the job, its worker thread waking, the result back (default 0)
    serving_on_worker_cores  (top level, optional) true when the workers take every core: request_us
                        then needs a host worker's time, an idle one's if any, else it stretches a
                        busy one's task (simulate.py; default false)

`modelcache place --describe` fills request_us and handoff_us with what serve mode was measured to
add on this machine (machine.py), so the simulator predicts the daemon's latency, not ORT's alone.

Links are full duplex: each direction of each pair is its own resource. Two memory nodes without
a direct link talk through "host" (two hops), as devices on a PCIe tree do. A kind named cpuN (N
threads) is this machine's CPU group of N cores, the executor's name for it: its node costs are
measured with ORT's profiler, while the other kinds' are modelled (costs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError

HOST = "host"
KIND_RATES = ("conv_gflop_s", "matmul_gflop_s", "other_gflop_s", "mem_gbyte_s")
KIND_KEYS = (*KIND_RATES, "launch_us", "comment")
WORKER_KEYS = ("name", "kind", "memory_node", "memory_gbyte", "group")
LINK_KEYS = ("nodes", "gbit_per_s", "latency_us")


class SystemDescriptionError(InputError):
    """A system description that cannot be used; the message says which entry and why."""


@dataclass(frozen=True)
class Kind:
    name: str
    conv_gflop_s: float
    matmul_gflop_s: float
    other_gflop_s: float
    mem_gbyte_s: float
    launch_us: float = 0.0
    comment: str = ""


@dataclass(frozen=True)
class WorkerSpec:
    name: str
    kind: str
    memory_node: str = HOST
    memory_gbyte: float = math.inf
    group: str = ""


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    bytes_per_s: float
    latency_s: float


@dataclass
class System:
    name: str
    kinds: dict[str, Kind]
    workers: list[WorkerSpec]
    links: dict[tuple[str, str], Link] = field(default_factory=dict)   # (src, dst) -> link, both directions
    request_s: float = 0.0     # serving's cost per request outside the stages (client, IPC): a delay
    handoff_s: float = 0.0     # serving's cost per stage outside its run (queue, thread wake-up): a delay
    # True when the workers' groups take every core, so the client's and the daemon's work for a request
    # (request_s) runs on a worker's cores: under load it takes an idle host worker's time, else stretches
    # a busy one's (simulate.py), not a free delay. Measured here (benchmarks/placement/check, 2 cores, groups
    # "1,1" and "2"): on one worker served throughput sat about one request_s a request below the stages'
    # run times; on "1,1" the less busy worker absorbed it.
    serving_on_worker_cores: bool = False

    def groups(self) -> list[list[int]]:
        """Worker indices by group, in order of first appearance; ungrouped workers form one group each."""
        by_group: dict[str, list[int]] = {}
        for i, w in enumerate(self.workers):
            by_group.setdefault(w.group or f"#{i}", []).append(i)
        return list(by_group.values())

    def route(self, src: str, dst: str) -> list[tuple[str, str]]:
        """The hops (link keys) from memory node src to dst: none within a node, a direct link, else via host."""
        if src == dst:
            return []
        if (src, dst) in self.links:
            return [(src, dst)]
        if (src, HOST) in self.links and (HOST, dst) in self.links:
            return [(src, HOST), (HOST, dst)]
        raise SystemDescriptionError(f"system {self.name!r}: no link from {src!r} to {dst!r}, directly or through host")


def _number(where: str, key: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise SystemDescriptionError(f"{where}: {key} = {value!r} is not a number")
    if value < 0 or (positive and value == 0):
        raise SystemDescriptionError(f"{where}: {key} = {value!r} must be {'positive' if positive else 'at least 0'}")
    return float(value)


def _flag(where: str, key: str, value) -> bool:
    if not isinstance(value, bool):
        raise SystemDescriptionError(f"{where}: {key} = {value!r} is not true or false")
    return value


def _check_keys(where: str, table, allowed) -> None:
    if not isinstance(table, dict):
        raise SystemDescriptionError(f"{where}: expected a table, got {type(table).__name__}")
    unknown = [k for k in table if k not in allowed]
    if unknown:
        raise SystemDescriptionError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(allowed)}")


def parse_system(data: dict, source: str = "system") -> System:
    """A System from the TOML tables; SystemDescriptionError names the first thing wrong."""
    _check_keys(source, data, ("name", "comment", "kinds", "workers", "links", "request_us", "handoff_us",
                                     "serving_on_worker_cores"))
    kinds = {}
    for name, table in (data.get("kinds") or {}).items():
        where = f"{source}: kinds.{name}"
        _check_keys(where, table, KIND_KEYS)
        missing = [k for k in KIND_RATES if k not in table]
        if missing:
            raise SystemDescriptionError(f"{where}: missing {', '.join(missing)} (peak rates of the roofline model)")
        kinds[name] = Kind(name, *(_number(where, k, table[k]) for k in KIND_RATES),
                           launch_us=_number(where, "launch_us", table.get("launch_us", 0.0), positive=False),
                           comment=str(table.get("comment", "")))
    workers = []
    raw_workers = data.get("workers") or []
    if not isinstance(raw_workers, list) or not raw_workers:
        raise SystemDescriptionError(f"{source}: no [[workers]]; a system needs at least one")
    for i, table in enumerate(raw_workers):
        where = f"{source}: workers[{i}]"
        _check_keys(where, table, WORKER_KEYS)
        if "name" not in table or "kind" not in table:
            raise SystemDescriptionError(f"{where}: give name and kind")
        if table["kind"] not in kinds:
            raise SystemDescriptionError(f"{where} ({table['name']}): unknown worker kind {table['kind']!r}; "
                               f"the [kinds] tables define {', '.join(kinds) or 'none'}")
        mem = table.get("memory_gbyte")
        workers.append(WorkerSpec(str(table["name"]), table["kind"], str(table.get("memory_node", HOST)),
                                  math.inf if mem is None else _number(where, "memory_gbyte", mem),
                                  str(table.get("group", ""))))
    names = [w.name for w in workers]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise SystemDescriptionError(f"{source}: two workers are named {dup!r}")
    nodes = {HOST, *(w.memory_node for w in workers)}
    links: dict = {}
    for i, table in enumerate(data.get("links") or []):
        where = f"{source}: links[{i}]"
        _check_keys(where, table, LINK_KEYS)
        members = table.get("nodes")
        if not isinstance(members, list) or len(members) < 2:
            raise SystemDescriptionError(f"{where}: nodes = [A, B, ...] names at least two memory nodes")
        stray = [n for n in members if n not in nodes]
        if stray:
            raise SystemDescriptionError(f"{where}: {stray[0]!r} is no worker's memory node (known: {', '.join(sorted(nodes))})")
        bw = _number(where, "gbit_per_s", table.get("gbit_per_s")) * 1e9 / 8
        lat = _number(where, "latency_us", table.get("latency_us", 0.0), positive=False) * 1e-6
        for a in members:
            for b in members:
                if a != b:
                    links[(a, b)] = Link(a, b, bw, lat)
    system = System(str(data.get("name", source)), kinds, workers, links,
                    *(_number(source, k, data.get(k, 0.0), positive=False) * 1e-6 for k in ("request_us", "handoff_us")),
                    serving_on_worker_cores=_flag(source, "serving_on_worker_cores", data.get("serving_on_worker_cores", False)))
    for node in nodes:   # every memory node must reach every other: a plan may move data between any two
        for other in nodes:
            system.route(node, other)
    return system


def load_system(path: str | Path) -> System:
    from ..config import read_toml
    return parse_system(read_toml(path, "system description", SystemDescriptionError), str(path))


# -- writing -------------------------------------------------------------------------------
def _toml_value(v) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(round(v, 6)) if math.isfinite(v) else "inf"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def _key(name: str) -> str:
    return name if name.replace("_", "").replace("-", "").isalnum() else _toml_value(name)


def format_system(system: System, header: str = "") -> str:
    """TOML text that parse_system reads back as the same System (a small writer for this one schema)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines.append(f"name = {_toml_value(system.name)}")
    lines += [f"request_us = {_toml_value(system.request_s * 1e6)}", f"handoff_us = {_toml_value(system.handoff_s * 1e6)}",
              f"serving_on_worker_cores = {_toml_value(system.serving_on_worker_cores)}"]
    for kind in system.kinds.values():
        lines += ["", f"[kinds.{_key(kind.name)}]"]
        if kind.comment:
            lines.append(f"comment = {_toml_value(kind.comment)}")
        lines += [f"{k} = {_toml_value(getattr(kind, k))}" for k in (*KIND_RATES, "launch_us")]
    for w in system.workers:
        lines += ["", "[[workers]]", f"name = {_toml_value(w.name)}", f"kind = {_toml_value(w.kind)}",
                  f"memory_node = {_toml_value(w.memory_node)}"]
        if math.isfinite(w.memory_gbyte):
            lines.append(f"memory_gbyte = {_toml_value(w.memory_gbyte)}")
        if w.group:
            lines.append(f"group = {_toml_value(w.group)}")
    seen = set()
    for (a, b), link in system.links.items():
        if (b, a) in seen:
            continue
        seen.add((a, b))
        lines += ["", "[[links]]", f"nodes = {_toml_value([a, b])}",
                  f"gbit_per_s = {_toml_value(link.bytes_per_s * 8 / 1e9)}",
                  f"latency_us = {_toml_value(link.latency_s * 1e6)}"]
    return "\n".join(lines) + "\n"
