"""Pictures of plans: a Gantt chart of the planned schedule, and bars of plan vs baselines per model."""

from __future__ import annotations

from pathlib import Path

from .simulate import simulate

PIPELINED_REQUESTS = 3     # the Gantt chart shows a few requests back to back, so overlap is visible


def plot_gantt(placement, path: Path, requests: int = PIPELINED_REQUESTS) -> Path | None:
    """The simulator's schedule of `requests` arriving together: one row per worker and link."""
    from ..plotting import pyplot
    plt = pyplot()
    if plt is None:
        return None
    cost, plan = placement.cost, placement.plan
    result = simulate(cost, plan, [0.0] * requests)
    rows = list(dict.fromkeys([w.name for w in cost.system.workers] +
                              sorted({i.resource for i in result.intervals if i.resource.startswith("link")})))
    used = [r for r in rows if any(i.resource == r for i in result.intervals)]
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(used) + 1.6))
    for i in result.intervals:
        y = used.index(i.resource)
        ax.barh(y, (i.end - i.start) * 1e3, left=i.start * 1e3, color=colours(i.stage % 10),
                alpha=1.0 - 0.25 * (i.request % 3), edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(used)), used)
    ax.invert_yaxis()
    ax.set_xlabel("ms (colour: stage; shade: request)")
    ax.set_title(f"{cost.table.model} on {cost.system.name}: {len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}, batch {plan.batch}, "
                 f"{requests} requests at once")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_bars(reports: list, path: Path, metric: str = "latency_s") -> Path | None:
    """Grouped bars: per model, the plan and each baseline (ms of one request's latency)."""
    from ..plotting import pyplot
    plt = pyplot()
    if plt is None:
        return None
    methods = list(dict.fromkeys(r["method"] for rep in reports for r in rep["rows"]))
    fig, ax = plt.subplots(figsize=(1.6 + 1.9 * len(reports), 4))
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        xs, ys = [], []
        for x, rep in enumerate(reports):
            row = next((r for r in rep["rows"] if r["method"] == m), None)
            if row is not None:
                xs.append(x + k * width)
                ys.append(row[metric] * 1e3)
        ax.bar(xs, ys, width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(reports))], [rep["model"] for rep in reports])
    ax.set_ylabel("latency of one request, ms (analytical)")
    ax.set_title(reports[0]["system"] if reports else "")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
