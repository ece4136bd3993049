"""Which binding of the CUDA driver read-only GPU sharing uses: ctypes (modelcache/cuda.py) or cuda-bindings.

    PYTHONPATH=. python benchmarks/binding/driver_import.py [--runs 21] [--out benchmarks/binding]

An attach client on a GPU maps the daemon's allocations through the driver's virtual memory API
(cuMemImportFromShareableHandle, cuMemMap, cuMemSetAccess) on its open path, after it has imported
onnxruntime. What each binding adds there is measured in fresh processes, the candidates interleaved:

  ctypes         `CudaDriver()` of modelcache/cuda.py: dlopen of libcuda, the prototypes, cuInit. No GPU
                 here, so libcuda is a stub compiled by this script (every call returns CUDA_SUCCESS): the
                 real library's load is left out, as it is for the other candidate (cuda-bindings loads
                 libcuda at its first call, not at import)
  cuda-bindings  `from cuda.bindings import driver` (NVIDIA's bindings; `pip install cuda-bindings`)

each after the imports an attach client has made by then ("after attach imports": onnxruntime,
modelcache.client.device) and alone after `import modelcache.cuda` ("alone"). Needs gcc for the stub.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STUB_C = r"""
#include <stddef.h>
typedef unsigned long long u64;
static const char *ok = "CUDA_SUCCESS";
int cuGetErrorName(int rc, const char **s) { *s = ok; return 0; }
int cuGetErrorString(int rc, const char **s) { *s = ok; return 0; }
int cuInit(unsigned flags) { return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) { *v = 1; return 0; }
int cuMemGetAllocationGranularity(size_t *g, const void *p, int o) { *g = 2 << 20; return 0; }
int cuMemCreate(u64 *h, size_t n, const void *p, u64 f) { *h = 1; return 0; }
int cuMemRelease(u64 h) { return 0; }
int cuMemExportToShareableHandle(void *fd, u64 h, int t, u64 f) { *(int *)fd = -1; return 0; }
int cuMemImportFromShareableHandle(u64 *h, void *fd, int t) { *h = 1; return 0; }
int cuMemAddressReserve(u64 *va, size_t n, size_t a, u64 at, u64 f) { *va = 1ULL << 40; return 0; }
int cuMemAddressFree(u64 va, size_t n) { return 0; }
int cuMemMap(u64 va, size_t n, size_t o, u64 h, u64 f) { return 0; }
int cuMemUnmap(u64 va, size_t n) { return 0; }
int cuMemSetAccess(u64 va, size_t n, const void *d, size_t c) { return 0; }
"""

ATTACH_IMPORTS = "import onnxruntime, modelcache.client.device\n"
ALONE_IMPORTS = "import modelcache.cuda\n"
MEASURE = {
    "ctypes": "from modelcache.cuda import CudaDriver\nt = time.perf_counter()\nCudaDriver(names=[STUB])\n",
    "cuda-bindings": "t = time.perf_counter()\nfrom cuda.bindings import driver\n",
}


def build_stub(directory: Path) -> Path:
    src, lib = directory / "stub_cuda.c", directory / "libcuda.so.1"
    src.write_text(STUB_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return lib


def one_sample(candidate: str, before: str, stub: Path) -> float:
    code = (f"import time\nSTUB = {str(stub)!r}\n{before}{MEASURE[candidate]}"
            "print((time.perf_counter() - t) * 1e3)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", ".")})
    return float(out.stdout.strip().splitlines()[-1])


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21, help="fresh processes per candidate and setting")
    ap.add_argument("--out", help="directory for results.json and driver_import.txt")
    args = ap.parse_args(argv)
    settings = {"after attach imports": ATTACH_IMPORTS, "alone": ALONE_IMPORTS}
    samples = {(s, c): [] for s in settings for c in MEASURE}
    with tempfile.TemporaryDirectory(prefix="mc-driver-stub-") as tmp:
        stub = build_stub(Path(tmp))
        for _ in range(args.runs):       # interleaved: load from other processes hits every candidate alike
            for (setting, candidate), xs in samples.items():
                xs.append(one_sample(candidate, settings[setting], stub))
    lines = [f"$ PYTHONPATH=. python benchmarks/binding/driver_import.py --runs {args.runs}"
             + (f" --out {args.out}" if args.out else ""),
             f"{'setting':<22} {'candidate':<14} {'median ms':>10} {'q1 ms':>8} {'q3 ms':>8}"]
    results = {}
    for (setting, candidate), xs in samples.items():
        q1, med, q3 = quartiles(xs)
        results.setdefault(setting, {})[candidate] = {"median_ms": med, "q1_ms": q1, "q3_ms": q3, "samples_ms": xs}
        lines.append(f"{setting:<22} {candidate:<14} {med:>10.2f} {q1:>8.2f} {q3:>8.2f}")
    for setting, r in results.items():
        lines.append(f"{setting}: cuda-bindings / ctypes = "
                     f"{r['cuda-bindings']['median_ms'] / r['ctypes']['median_ms']:.1f}x (medians)")
    report = "\n".join(lines)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "driver_import.txt").write_text(report + "\n")
        (out / "driver_import.json").write_text(json.dumps({"runs": args.runs, "python": sys.version.split()[0],
                                                            "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
