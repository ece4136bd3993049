"""The GPU session's plan: each step's time limit and estimate, what it needs, and the device calls that fit 15 minutes.

Standard library only. prepare.py prints the calls; verify.sh takes each step's limit and needs from here
(`python3 plan.py bash`), so the limits the calls are sized by are the ones the steps run under.

Estimates come from shared/GPU.md's figures measured on an H100 and from the 30-minute kit's runs of the same
steps (benchmarks/gpu/README.md before issue #36); a limit is about twice its estimate. A device session
is 15 minutes in all: a cold machine start (up to 2), each call's transfer and reply, idle gaps over 30 s
end it. The plan's total (cold start + every call's limit and transfer) must stay within PLAN_LIMIT_S.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

COLD_START_S = 120           # device README: a machine starts in 1-2 minutes
CARRY_TRANSFER_S = 15        # a call carrying ~60 MiB: the copy there and its check (estimate, not measured)
REPLY_S = 5                  # a call carrying nothing: the tree (5 MiB) and the report coming back
PLAN_LIMIT_S = 12 * 60       # of the 15 minutes: 3 left for the lead's own slowness
CALL_REPORT_S = 15           # of each call's timeout: left for writing the report after the last step


@dataclass(frozen=True)
class Step:
    limit_s: int
    estimate_s: int
    needs: tuple = ()        # steps that must have ended "ok" (in this call or an earlier one) before this one
    basis: str = ""          # where the estimate comes from


STEPS = {
    "stage": Step(30, 5, (), "sha256 of the carried parts (~60 MiB) and a copy into $STATE"),
    "zmq": Step(20, 3, (), "pyzmq 0.8 MiB: unzip, import"),
    "tier": Step(170, 105, ("zmq",),
                 "pytest -m 'gpu and not cuda_ep' (the tier's contract over cudaMalloc, ~15 tests on tiny models) and "
                 "every check_*.py (~75 s: a daemon adds ResNet-50 and lends it to two cupy importers, SIGKILLs, "
                 "exports without it; a 512 MiB pinned-copy run; check_vmm's read-only maps), each under its own "
                 "limit"),
    "ort": Step(60, 20, (), "reassemble the 57 MiB kit, Python lzma unpacks it (~11 s on the CPU here, GPU.md), "
                            "link the image's nvidia libraries"),
    "probe": Step(60, 15, ("ort",), "import onnxruntime 0.25 s, preload_dlls 0.06, CUDA context 0.12 (GPU.md), a "
                                    "1-node session run on CUDA with lazy and with eager module loading"),
    "tests": Step(90, 30, ("probe",), "pytest -m 'gpu and cuda_ep': two tests, each a small CUDA session"),
    "bench": Step(200, 100, ("probe",), "bench coldstart --device cuda, VGG16 only, 3 runs of 4 modes (~2 s each), "
                                        "memory with 4 clients; the 30-minute kit's 5 runs of 6 modes took 3-5 min"),
    "dropin": Step(120, 50, ("probe",), "VGG16 built (7 s here) and added, then 3 fresh processes of ~2 s "
                                        "(GPU.md: ort-cuda 2.12 s to first result)"),
}
ORDER = list(STEPS)
# What the steps run (verify.sh reads these too): small enough for the limits above.
BENCH_ARGS = "--models vgg16 --runs 3 --clients 4 --modes ort-cuda gpu-attach-hit serve ideal"
DROPIN_ARGS = "--models vgg16 --rounds 1"


@dataclass(frozen=True)
class Call:
    steps: tuple
    carry: tuple
    timeout_s: int
    why: str

    @property
    def command(self) -> str:
        return f"bash benchmarks/gpu/verify.sh --budget {self.timeout_s - CALL_REPORT_S} {' '.join(self.steps)}"

    @property
    def estimate_s(self) -> int:
        return sum(STEPS[s].estimate_s for s in self.steps if s in STEPS)


class PlanError(Exception):
    """The kit does not leave room for a plan within the session."""


def calls(kit_calls: int) -> list[Call]:
    """The device calls, back to back, for a kit carried in `kit_calls` calls (1 or 2)."""
    if kit_calls == 1:
        return [Call(("stage", "zmq", "tier", "ort", "probe"), (".gpukit/call1",), 240,
                     "the tier without onnxruntime-gpu first (its report comes back whatever follows), then the "
                     "compacted onnxruntime-gpu, checked on CUDA"),
                Call(("tests", "bench", "dropin"), (), 255, "what needs the CUDA provider: gpu tests, cold start "
                                                            "and memory, outputs compared"),
                Call(("again",), (), 75, "at once, only if a step failed or ran out of time: those steps again")]
    if kit_calls == 2:
        return [Call(("stage", "zmq", "tier"), (".gpukit/call1",), 170,
                     "the tier without onnxruntime-gpu (its report comes back whatever follows); the kit's first part"),
                Call(("stage", "ort", "probe", "tests", "bench", "dropin"), (".gpukit/call2",), 310,
                     "the kit's second part, then all that needs the CUDA provider"),
                Call(("again",), (), 75, "at once, only if a step failed or ran out of time: those steps again")]
    raise PlanError(f"the kit needs {kit_calls} calls: with a call for the checks that leaves no plan within "
                    f"{PLAN_LIMIT_S // 60} minutes (make the working tree smaller, or the kit: --arch)")


def total_s(plan: list[Call]) -> int:
    """Worst case: a cold start, and every call running to its limit, with its transfer."""
    return COLD_START_S + sum(c.timeout_s + (CARRY_TRANSFER_S if c.carry else REPLY_S) for c in plan)


def expected_s(plan: list[Call]) -> int:
    """As estimated: a cold start, each step's estimate, the transfers; the last call only if something failed."""
    return COLD_START_S + sum(c.estimate_s + (CARRY_TRANSFER_S if c.carry else REPLY_S) for c in plan[:-1])


def describe(plan: list[Call]) -> str:
    t, lines = COLD_START_S, [f"Device calls (make them back to back: 30 s idle and the machine goes back). Cold "
                              f"start: up to {COLD_START_S} s."]
    for i, c in enumerate(plan, 1):
        t += c.timeout_s + (CARRY_TRANSFER_S if c.carry else REPLY_S)
        lines.append(f"{i}. run(command={c.command!r}, carry={list(c.carry)!r}, timeout_s={c.timeout_s})")
        lines.append(f"   {c.why}; steps estimated at {c.estimate_s} s; by {t // 60}:{t % 60:02d} at the latest")
    total, expected = total_s(plan), expected_s(plan)
    lines.append(f"Plan total: {total // 60}:{total % 60:02d} at the latest (limit {PLAN_LIMIT_S // 60}:00), "
                 f"~{expected // 60}:{expected % 60:02d} expected without call {len(plan)}.")
    return "\n".join(lines)


def bash() -> str:
    """verify.sh's tables: each step's limit and needs, and what the steps run."""
    out = [f"CAP[{n}]={s.limit_s}; NEEDS[{n}]=\"{' '.join(s.needs)}\"" for n, s in STEPS.items()]
    out += [f"ORDER=\"{' '.join(ORDER)}\"", f"BENCH_ARGS=\"{BENCH_ARGS}\"", f"DROPIN_ARGS=\"{DROPIN_ARGS}\""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if argv == ["bash"]:
        print(bash())
        return 0
    if len(argv) == 1 and argv[0].isdigit():
        try:
            print(describe(calls(int(argv[0]))))
        except PlanError as e:
            print(f"plan: {e}", file=sys.stderr)
            return 1
        return 0
    print("usage: plan.py bash | plan.py KIT_CALLS", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
