#!/usr/bin/env bash
# Triton's perf_analyzer (C++), for the test that drives the fronts with it (tests/test_perf_analyzer.py).
# PyPI's `perf-analyzer` is a 0.1.0 placeholder; the tritonclient 2.41.0 manylinux wheel still carries the
# binary. It needs libb64.so.0d (Debian's libb64-0d) and libcudart.so.12 (PyPI's nvidia-cuda-runtime-cu12),
# even on CPU. Puts them in DEST and prints the binary's path; fails (and the test skips) where it cannot.
#   bash .ci/perf_analyzer.sh DEST
set -euo pipefail
DEST=$(mkdir -p "$1" && cd "$1" && pwd)
if [ ! -x "$DEST/perf_analyzer" ]; then
  python -m pip download -q --no-deps tritonclient==2.41.0 --platform manylinux1_x86_64 --only-binary=:all: -d "$DEST"
  python -m pip download -q --no-deps nvidia-cuda-runtime-cu12 --platform manylinux2014_x86_64 \
    --only-binary=:all: -d "$DEST"
  python - "$DEST" <<'PY'
import glob, os, sys, zipfile
d = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{d}/tritonclient-2.41.0-*.whl")[0]) as z:
    open(f"{d}/perf_analyzer", "wb").write(z.read("tritonclient-2.41.0.data/data/bin/perf_analyzer"))
with zipfile.ZipFile(glob.glob(f"{d}/nvidia_cuda_runtime_cu12-*.whl")[0]) as z:
    lib = next(n for n in z.namelist() if n.endswith("/libcudart.so.12"))
    open(f"{d}/libcudart.so.12", "wb").write(z.read(lib))
os.chmod(f"{d}/perf_analyzer", 0o755)
PY
  rm -f "$DEST"/*.whl
fi
if ! ldconfig -p | grep -q libb64.so.0d; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get install -y -q libb64-0d || (apt-get update -q && apt-get install -y -q libb64-0d)) >/dev/null 2>&1
  fi
fi
LD_LIBRARY_PATH=$DEST "$DEST/perf_analyzer" --version >/dev/null
echo "$DEST/perf_analyzer"
