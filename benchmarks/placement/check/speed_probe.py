"""Does this machine's CPU speed hold still? ORT MatMul rates on 2 threads and on 1, back to back, for a while.

    PYTHONPATH=. python benchmarks/placement/check/speed_probe.py [SECONDS]

Prints, every ~0.15 s: seconds since start, the best of 5 768^3 MatMuls on 2 threads and of 3 on 1
(GFLOP/s, machine.matmul_gflop_s, as `place --describe` measures the CPU), the CPUs' reported MHz,
and the steal time in between. Run on an otherwise idle machine: where the rates move with no other
process running and no steal, the speed a profile measures is not the speed a later phase runs at.
"""

import sys
import time

import psutil

from modelcache.placement.machine import matmul_gflop_s


def main(seconds: float) -> None:
    t0 = time.time()
    while time.time() - t0 < seconds:
        c0 = psutil.cpu_times()
        g2, g1 = matmul_gflop_s(2, runs=5), matmul_gflop_s(1, runs=3)
        c1 = psutil.cpu_times()
        mhz = [line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("cpu MHz")]
        print(f"{time.time() - t0:5.1f}s  2 threads {g2:6.1f} GFLOP/s  1 thread {g1:6.1f}  MHz {mhz} "
              f"steal {c1.steal - c0.steal:.2f}", flush=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 20.0)
