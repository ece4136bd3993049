#!/usr/bin/env bash
# The GPU tier's verification on the lent GPU machine, a few steps per device call; after every step it writes
# $OUT/gpu-report/ (report.json, report.md, junit xml, logs.tar.gz), so a call cut short keeps what ran.
#
#   bash benchmarks/gpu/verify.sh [--dry-run] [--budget SECONDS] STEP...
#
# Steps, in a session's order (prepare.py prints the calls; plan.py holds each step's limit and needs):
#   stage   check the kit parts this call carried (.gpukit/callN) by sha256; keep them in $STATE
#   zmq     pyzmq from the kit into $STATE/site-zmq (the image lacks it)
#   tier    with NO onnxruntime-gpu (the image's cupy, cuda-bindings, CPU onnxruntime): every check_*.py
#           (checks.py run), then pytest -m "gpu and not cuda_ep"
#   ort     the compacted onnxruntime-gpu into $STATE/site-ort, the image's nvidia libraries linked beside it
#   probe   the device, and a session on the CUDA provider with the compacted library (lazy and eager loading);
#           when it fails, every step that needs it is skipped: the tier's results are what the session has
#   tests   pytest -m "gpu and cuda_ep"
#   bench   modelcache bench coldstart --device cuda (VGG16: cold start, memory with 4 clients, promotion)
#   dropin  modelcache.InferenceSession on CUDA against plain ort-cuda: outputs compared (VGG16)
#   again   the steps that did not end "ok" so far, in order
# A step runs under its own limit, cut to what is left of --budget (a call's timeout less the report), and is
# skipped, said so, when a step it needs did not end "ok". What later calls need lives in $STATE (default
# /var/tmp/modelcache-gpukit), which lasts while the machine stays warm (30 s after a call). No venv: the
# image's python3 is one already; PYTHONPATH puts the repository and the kit's folders first.
# MODELCACHE_GPUKIT_KIT names where the carried call folders arrive (default: .gpukit in the repository).
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
STATE=${MODELCACHE_GPUKIT_STATE:-/var/tmp/modelcache-gpukit}
KIT=${MODELCACHE_GPUKIT_KIT:-$REPO/.gpukit}
ZMQ_SITE=$STATE/site-zmq
ORT_SITE=$STATE/site-ort
LOGS=$STATE/logs
REPORT_DIR=${OUT:-$STATE/out}/gpu-report
PY=${PYTHON:-python3}
BUDGET=570
DRY=
declare -A CAP NEEDS
eval "$(env -u PYTHONPATH "$PY" "$HERE/plan.py" bash)" || { echo "verify: plan.py failed" >&2; exit 2; }
export PYTHONUNBUFFERED=1

x() {   # run a command, or only show it with --dry-run
    echo "+ $*"
    [ -n "$DRY" ] || "$@"
}

with_tier() {   # the repository and pyzmq: no onnxruntime-gpu, the image's CPU onnxruntime
    PYTHONPATH="$REPO:$ZMQ_SITE" LD_LIBRARY_PATH="$(nvidia_libs)" "$@"
}

with_ort() {    # the compacted onnxruntime-gpu first
    PYTHONPATH="$REPO:$ORT_SITE:$ZMQ_SITE" LD_LIBRARY_PATH="$(nvidia_libs)" "$@"
}

nvidia_libs() {   # where the image's libcudart is (pip nvidia-cuda-runtime), for modelcache.cuda's ctypes loader
    [ -n "$DRY" ] && { echo "(the image's nvidia/cu13/lib)"; return; }
    env -u PYTHONPATH "$PY" -c 'import glob, os, nvidia
print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(d + "/**/libcudart.so*", recursive=True)})))' \
        2>/dev/null || true
    [ -n "${LD_LIBRARY_PATH:-}" ] && printf ':%s' "$LD_LIBRARY_PATH"
}

gpu_test_files() {
    (cd "$REPO" && grep -l 'pytest.mark.gpu' tests/test_*.py | tr '\n' ' ')
}

step_stage() {
    if ! compgen -G "$KIT/call*/manifest.json" >/dev/null && [ -z "$DRY" ]; then
        echo "nothing carried by this call (no $KIT/callN): what an earlier call staged is used"
        return 0
    fi
    x "$PY" "$HERE/chunks.py" stage "$KIT" "$STATE"
}

step_zmq() {
    x rm -rf "$ZMQ_SITE"
    x "$PY" "$HERE/chunks.py" assemble "$STATE" "$STATE/files" 'pyzmq-*.whl' || return 1
    x "$PY" -m zipfile -e "$(ls "$STATE"/files/pyzmq-*.whl 2>/dev/null || echo "$STATE/files/pyzmq-X.whl")" "$ZMQ_SITE" \
        || return 1
    x env PYTHONPATH="$ZMQ_SITE" "$PY" -c 'import zmq; print("pyzmq", zmq.__version__, "libzmq", zmq.zmq_version())'
}

step_tier() {
    local rc=0 files
    # The checks first: they measure what no test does; each has its own limit (LIMIT_S in its file). Each
    # rewrites its own result: a step run again, and cut short, keeps what the first run found.
    x with_tier "$PY" "$HERE/checks.py" run --out "$STATE/checks" --budget $((CAP_NOW - 55)) || rc=1
    files=$(gpu_test_files)
    # shellcheck disable=SC2086
    (cd "$REPO" && x with_tier timeout -k 5 45 "$PY" -m pytest -o addopts= -m "gpu and not cuda_ep" -q -rs -p no:cacheprovider \
        --junitxml="$STATE/junit-tier.xml" $files) || rc=1
    return $rc
}

step_ort() {
    x rm -rf "$ORT_SITE"
    x "$PY" "$HERE/chunks.py" assemble "$STATE" "$STATE/files" 'ort-kit-*' || return 1
    x "$PY" "$HERE/ortkit.py" unpack "$(ls "$STATE"/files/ort-kit-*.tar.xz 2>/dev/null || echo "$STATE/files/ort-kit.tar.xz")" \
        "$ORT_SITE" --record "$STATE/kit-unpack.json" || return 1
    # onnxruntime.preload_dlls() looks for the CUDA and cuDNN libraries next to the onnxruntime package.
    local nv="(the image's nvidia folder)"
    [ -n "$DRY" ] || nv=$(env -u PYTHONPATH "$PY" -c 'import os, nvidia
print(next((p for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cudnn"))), list(nvidia.__path__)[0]))') \
        || { echo "verify: the image's python3 has no nvidia CUDA library packages (nvidia-cudnn-cu13 ...)"; return 1; }
    x ln -sfn "$nv" "$ORT_SITE/nvidia"
    x with_ort "$PY" "$HERE/probe.py" --installed "$ORT_SITE"
}

step_probe() {
    x rm -f "$STATE/device.json"
    x with_ort "$PY" "$HERE/probe.py" --out "$STATE/device.json"
}

step_tests() {
    local files
    x rm -f "$STATE/junit-ort.xml"
    files=$(gpu_test_files)
    # shellcheck disable=SC2086
    (cd "$REPO" && x with_ort "$PY" -m pytest -o addopts= -m "gpu and cuda_ep" -q -rs -p no:cacheprovider \
        --junitxml="$STATE/junit-ort.xml" $files)
}

step_dropin() {
    x rm -f "$STATE/dropin.json"
    # shellcheck disable=SC2086
    x with_ort "$PY" "$HERE/dropin.py" $DROPIN_ARGS --out "$STATE/dropin.json"
}

step_bench() {
    x rm -rf "$STATE/bench/vgg16"
    # shellcheck disable=SC2086
    x with_ort "$PY" -m modelcache.cli bench coldstart --device cuda $BENCH_ARGS --out "$STATE/bench/vgg16"
}

collect() {
    env -u PYTHONPATH "$PY" "$HERE/report.py" collect "$STATE" "$REPORT_DIR" >/dev/null \
        || echo "verify: writing the report failed (see above)"
}

record() {   # NAME STATUS RC SECONDS CAP [WHY]
    env -u PYTHONPATH "$PY" "$HERE/report.py" step "$STATE" "$@"
}

unmet_need() {   # NAME: the first step NAME needs that has not ended "ok", with how it ended; "" when none
    local n status
    for n in ${NEEDS[$1]}; do
        status=$(env -u PYTHONPATH "$PY" "$HERE/report.py" status "$STATE" "$n")
        [ "$status" = ok ] || { echo "$n ($status)"; return; }
    done
}

run_step() {   # NAME: the step under its limit, its log in $LOGS, its outcome in the report; 1 if not ok
    local name=$1 cap=${CAP[$1]} left t0 rc need
    left=$((START + BUDGET - $(date +%s)))
    ((cap > left)) && cap=$left
    if [ -n "$DRY" ]; then
        echo "== $name (up to ${cap} s; needs: ${NEEDS[$name]:-nothing})"
        CAP_NOW=$cap "step_$name"
        return 0
    fi
    need=$(unmet_need "$name")
    if [ -n "$need" ]; then
        echo "== $name: skipped, it needs $need"
        record "$name" skipped 0 0 "$cap" "needs $need"
        collect
        return 1
    fi
    if ((cap < 15)); then
        echo "== $name: skipped, ${left} s left of this call's ${BUDGET} s"
        record "$name" skipped 0 0 "$cap" "${left} s left of the call's budget"
        collect
        return 1
    fi
    echo "== $name (up to ${cap} s) $(date -u +%H:%M:%S)"
    t0=$(date +%s)
    CAP_NOW=$cap timeout -k 10 "$cap" bash "${BASH_SOURCE[0]}" --one "$name" >"$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 12 "$LOGS/$name.log"
    local status=ok
    case $rc in 0) ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    echo "== $name: $status (rc $rc) in $(($(date +%s) - t0)) s"
    record "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$cap"
    collect
    [ "$status" = ok ]
}

not_ok_steps() {   # for `again`: the steps recorded so far that did not end "ok", in order
    local s status
    for s in $ORDER; do
        [ "$s" = stage ] && continue
        status=$(env -u PYTHONPATH "$PY" "$HERE/report.py" status "$STATE" "$s")
        [ "$status" = ok ] || [ "$status" = "not run" ] || echo "$s"
    done
}

main() {
    local steps=()
    while (($#)); do
        case $1 in
        --dry-run) DRY=1 ;;
        --budget) BUDGET=$2; shift ;;
        --one) shift; cd "$REPO" && "step_$1"; return ;;
        again) steps+=(again) ;;
        -h | --help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; return 0 ;;
        *)
            if [[ " $ORDER " != *" $1 "* ]]; then
                echo "verify: unknown step '$1' (steps: $ORDER again; --help says what each does)" >&2
                return 2
            fi
            steps+=("$1") ;;
        esac
        shift
    done
    ((${#steps[@]})) || { echo "verify: name the steps to run (steps: $ORDER again; --help)" >&2; return 2; }
    START=$(date +%s)
    [ -n "$DRY" ] || mkdir -p "$STATE" "$LOGS" "$REPORT_DIR"
    local expanded=() s
    for s in "${steps[@]}"; do
        if [ "$s" = again ]; then
            if [ -n "$DRY" ]; then
                echo "== again: the steps not ok so far, from \$STATE/steps (none here: nothing ran)"
                continue
            fi
            # shellcheck disable=SC2207
            expanded+=($(not_ok_steps))
        else
            expanded+=("$s")
        fi
    done
    if [ -z "$DRY" ] && [ "${steps[*]}" = again ] && ((${#expanded[@]} == 0)); then
        echo "== again: every step that ran ended ok; nothing to do"
    fi
    local failed=0
    for s in "${expanded[@]}"; do
        run_step "$s" || failed=1
    done
    if [ -z "$DRY" ]; then
        collect
        echo "== report: $REPORT_DIR"
        sed -n '/^## Figures/,$p' "$REPORT_DIR/report.md" 2>/dev/null
    fi
    return $failed
}

main "$@"
