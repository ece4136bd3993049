"""Per-node costs per worker kind: measured where the kind runs here, a calibrated roofline elsewhere.

A kind named cpuN that this machine can run (N cores or fewer) takes the times ORT's profiler
measured on N threads, at batch 1; b samples cost b times that (an upper bound: ORT's CPU kernels
gain little from batching). Any other kind is modelled per node as

    max(b * flops / peak(op class), (weights + b * activations) / memory bandwidth) + launch

and divided by the efficiency the roofline shows on a measured kind for the same op class
(roofline / measured time, summed over that class's nodes), so a modelled kind is assumed as far
from its peak as the measured CPU is from its own. `CostTable.source` says which is which.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .profile import NodeFacts, op_class
from .system import System


@dataclass
class CostTable:
    """Everything the search needs of a model: node times per kind and batch, bytes at each boundary."""
    model: str
    nodes: list[str]
    batch: int                        # largest batch tabled
    prefix_s: dict                    # kind -> array (batch+1, n+1): seconds of nodes [0, j) at b samples
    cut_bytes: list[float]            # per sample; [0] model inputs, [i] boundary before node i, [n] outputs
    weight_prefix: np.ndarray         # (n+1,): weight bytes of nodes [0, j)
    source: dict = field(default_factory=dict)      # kind -> "measured" | "modelled (...)"
    # kind -> seconds a stage run takes longer on a worker of that kind that idled WAKE_AFTER_S or more
    # before it (profile.py's cold runs; the simulator adds it). Measured kinds only.
    wake_s: dict = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.nodes)

    def seconds(self, kind: str, i: int, j: int, b: int) -> float:
        """Nodes [i, j) with b samples on one worker of `kind`."""
        p = self.prefix_s[kind][b]
        return float(p[j] - p[i])

    def weights(self, i: int, j: int) -> float:
        return float(self.weight_prefix[j] - self.weight_prefix[i])

    @classmethod
    def from_node_seconds(cls, model: str, node_s: dict, cut_bytes, weight_bytes=None, source=None,
                          nodes=None) -> "CostTable":
        """From per-node seconds: node_s[kind] an array (batch+1, n) with row b the times at b samples."""
        first = np.asarray(next(iter(node_s.values())), dtype=float)
        batch, n = first.shape[0] - 1, first.shape[1]
        prefix = {k: np.concatenate([np.zeros((batch + 1, 1)), np.cumsum(np.asarray(v, float), axis=1)], axis=1)
                  for k, v in node_s.items()}
        w = np.zeros(n) if weight_bytes is None else np.asarray(weight_bytes, float)
        if len(cut_bytes) != n + 1:
            raise ValueError(f"cut_bytes has {len(cut_bytes)} entries; {n} nodes need {n + 1}")
        return cls(model, list(nodes or [f"n{i}" for i in range(n)]), batch, prefix, list(map(float, cut_bytes)),
                   np.concatenate([[0.0], np.cumsum(w)]), dict(source or {k: "given" for k in node_s}))


def roofline_s(kind, f: NodeFacts, b: int) -> float:
    """Seconds of one node at b samples on a kind running at its peak rates (launch cost not included)."""
    peak = {"conv": kind.conv_gflop_s, "matmul": kind.matmul_gflop_s, "other": kind.other_gflop_s}[op_class(f.op)]
    return max(b * f.flops / (peak * 1e9), (f.weight_bytes + b * f.activation_bytes) / (kind.mem_gbyte_s * 1e9))


def measured_kinds(system: System, facts: list[NodeFacts]) -> list[str]:
    """The system's kinds whose times the profile holds (cpuN measured here)."""
    have = set(facts[0].measured_s) if facts else set()
    return [k for k in system.kinds if k in have]


def efficiencies(kind, facts: list[NodeFacts]) -> dict[str, float]:
    """Per op class: the roofline's time over the time measured on `kind` (how near its peak it runs)."""
    reference = kind.name
    eff = {}
    for cls in ("conv", "matmul", "other"):
        mine = [f for f in facts if op_class(f.op) == cls]
        measured = sum(f.measured_s[reference] - kind.launch_us * 1e-6 for f in mine)
        model = sum(roofline_s(kind, f, 1) for f in mine)
        if mine and measured > 0 and model > 0:
            eff[cls] = min(1.0, model / measured)   # above 1: the declared peak is low; no kind beats its peak
    overall = min(1.0, sum(roofline_s(kind, f, 1) for f in facts) / max(1e-12, sum(f.measured_s[reference] for f in facts)))
    for cls in ("conv", "matmul", "other"):
        eff.setdefault(cls, overall)    # a class this model lacks: the model's overall figure
    return eff


def build_table(model: str, facts: list[NodeFacts], cut_bytes: list[float], system: System,
                batch: int, reference=None, measured_on: str = "this machine", wake_s: dict | None = None) -> CostTable:
    """`reference`: the Kind to calibrate on when the system has no measured kind (this machine's CPU);
    `measured_on`: where the measured kinds' profile ran, for CostTable.source; `wake_s`: threads -> a cold
    run's extra seconds on a CPU group of that many threads (PooledProfile.wake_s)."""
    measured = measured_kinds(system, facts)
    ref_kind = system.kinds[measured[0]] if measured else reference
    reference = ref_kind.name if ref_kind else None
    eff = efficiencies(ref_kind, facts) if ref_kind else {"conv": 1.0, "matmul": 1.0, "other": 1.0}
    node_s, source = {}, {}
    for name, kind in system.kinds.items():
        table = np.zeros((batch + 1, len(facts)))
        for b in range(1, batch + 1):
            if name in measured:
                table[b] = [b * f.measured_s[name] for f in facts]
            else:
                table[b] = [(roofline_s(kind, f, b) / eff[op_class(f.op)] + kind.launch_us * 1e-6) if f.flops or
                            f.activation_bytes else 0.0 for f in facts]
        node_s[name] = table
        source[name] = f"measured (ORT profiler, {measured_on})" if name in measured else (
            f"modelled (roofline, calibrated on {reference}: efficiency "
            + ", ".join(f"{c} {e:.2f}" for c, e in eff.items()) + ")" if reference else "modelled (roofline, peak rates)")
    table = CostTable.from_node_seconds(model, node_s, cut_bytes, [f.weight_bytes for f in facts], source,
                                        [f.name for f in facts])
    table.wake_s = {k: (wake_s or {}).get(int(k[3:]), 0.0) for k in measured if k[3:].isdigit()}
    return table
