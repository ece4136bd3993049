#!/usr/bin/env bash
# The GPU tier's verification on a bare GPU machine, some steps per device call; after every step it writes
# $OUT/gpu-report/ (report.json, report.md, junit-gpu.xml, logs.tar.gz), so a call cut short keeps the rest.
#
#   bash benchmarks/gpu/verify.sh [--dry-run] [--budget SECONDS] STEP...
#
# Steps, in a session's order (benchmarks/gpu/README.md gives the calls, prepare.py prints them):
#   stage        check the kit parts carried by this call (.gpukit/callN) by sha256 and keep them in $STATE
#   install      reassemble the wheels (sha256 of each), pip install them offline into $STATE/site, link the
#                image's CUDA libraries beside onnxruntime; check onnxruntime's CUDA provider and pyzmq
#   probe        the device (nvidia-smi), driver, CUDA, onnxruntime, cupy; a 1-node session on CUDA
#   dropin       modelcache.InferenceSession on the CUDA EP against plain ort-cuda: times and outputs
#   tests        pytest -m gpu over the test files that hold gpu tests (junit xml)
#   bench-vgg16  modelcache bench coldstart --device cuda for VGG16, with memory (1 2 4 8 clients) and promotion
#   bench-rest   the same for ResNet-50 and ViT-B/16, without the memory measurement
#   all          install probe dropin tests bench-vgg16 bench-rest
# Each step runs under its own time limit, cut to what is left of --budget (default 570 s: a 600 s call less
# the report), so one that overruns loses only itself. What later calls need lives in $STATE (default
# /var/tmp/modelcache-gpukit), which lasts while the machine stays warm (30 s after a call). The installed
# packages are a pip --target folder first on PYTHONPATH, the repository before it (no venv: a venv made from
# the image's python3, itself a venv, would not see the image's cupy, numpy and CUDA libraries).
# MODELCACHE_GPUKIT_KIT names where the carried call folders arrive (default: .gpukit in the repository).
set -u

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
STATE=${MODELCACHE_GPUKIT_STATE:-/var/tmp/modelcache-gpukit}
KIT=${MODELCACHE_GPUKIT_KIT:-$REPO/.gpukit}   # where the carried call folders arrive
SITE=$STATE/site
LOGS=$STATE/logs
REPORT_DIR=${OUT:-$STATE/out}/gpu-report
PY=${PYTHON:-python3}
BUDGET=570
DRY=
declare -A CAP=([stage]=90 [install]=240 [probe]=90 [dropin]=240 [tests]=300 [bench-vgg16]=540 [bench-rest]=540)
ORDER="stage install probe dropin tests bench-vgg16 bench-rest"
MODELS_DROPIN="vgg16 resnet50 vit_b_16"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

x() {   # run a command, or only show it with --dry-run
    echo "+ $*"
    [ -n "$DRY" ] || "$@"
}

step_stage() {
    x "$PY" "$HERE/chunks.py" stage "$KIT" "$STATE"
}

step_install() {
    if compgen -G "$KIT/call*/manifest.json" >/dev/null; then   # the last kit call stages and installs
        x "$PY" "$HERE/chunks.py" stage "$KIT" "$STATE" || return 1
    fi
    x rm -rf "$STATE/wheels" "$SITE"
    x "$PY" "$HERE/chunks.py" assemble "$STATE" "$STATE/wheels" || return 1
    x "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STATE"/wheels/*.whl \
        || return 1
    # onnxruntime.preload_dlls() looks for the CUDA and cuDNN libraries next to the onnxruntime package, so
    # the image's `nvidia` folder (cudnn-cu13, cublas, cuda-runtime ...) is linked into the target folder.
    local nv="(the image's nvidia folder)"
    [ -n "$DRY" ] || nv=$(env -u PYTHONPATH "$PY" -c 'import os, nvidia
print(next((p for p in nvidia.__path__ if os.path.isdir(os.path.join(p, "cudnn"))), list(nvidia.__path__)[0]))') \
        || { echo "verify: the image's python3 has no nvidia CUDA library packages (nvidia-cudnn-cu13 ...)"; return 1; }
    x ln -sfn "$nv" "$SITE/nvidia"
    x "$PY" "$HERE/probe.py" --installed "$SITE"
}

step_probe() {
    x rm -f "$STATE/device.json"   # each step's output goes first: a run cut short must not report an older one
    x "$PY" "$HERE/probe.py" --out "$STATE/device.json"
}

step_dropin() {
    x rm -f "$STATE/dropin.json"
    # shellcheck disable=SC2086
    x "$PY" "$HERE/dropin.py" --models $MODELS_DROPIN --rounds 3 --out "$STATE/dropin.json"
}

step_tests() {
    local files
    x rm -f "$STATE/junit-gpu.xml"
    files=$(cd "$REPO" && grep -l 'pytest.mark.gpu' tests/test_*.py | tr '\n' ' ')
    # shellcheck disable=SC2086
    (cd "$REPO" && x "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider --junitxml="$STATE/junit-gpu.xml" $files)
}

step_bench-vgg16() {
    x rm -rf "$STATE/bench/vgg16"
    x "$PY" -m modelcache.cli bench coldstart --device cuda --models vgg16 --runs 5 --clients 1 2 4 8 \
        --out "$STATE/bench/vgg16"
}

step_bench-rest() {
    x rm -rf "$STATE/bench/rest"
    x "$PY" -m modelcache.cli bench coldstart --device cuda --models resnet50 vit_b_16 --runs 5 --clients 0 \
        --out "$STATE/bench/rest"
}

collect() {
    env -u PYTHONPATH "$PY" "$HERE/report.py" collect "$STATE" "$REPORT_DIR" >/dev/null \
        || echo "verify: writing the report failed (see above)"
}

run_step() {   # NAME: the step under its time limit, its log in $LOGS, its outcome in the report; 1 if it failed
    local name=$1 cap=${CAP[$1]} left t0 rc
    left=$((START + BUDGET - $(date +%s)))
    ((cap > left)) && cap=$left
    if [ -n "$DRY" ]; then
        echo "== $name (up to ${cap} s)"
        ("step_$name")
        return 0
    fi
    if ((cap < 20)); then
        echo "== $name: skipped, ${left} s left of this call's ${BUDGET} s"
        env -u PYTHONPATH "$PY" "$HERE/report.py" step "$STATE" "$name" skipped 0 0 "$cap"
        collect
        return 1
    fi
    echo "== $name (up to ${cap} s) $(date -u +%H:%M:%S)"
    t0=$(date +%s)
    timeout -k 10 "$cap" bash "${BASH_SOURCE[0]}" --one "$name" >"$LOGS/$name.log" 2>&1
    rc=$?
    tail -n 12 "$LOGS/$name.log"
    local status=ok
    case $rc in 0) ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
    echo "== $name: $status (rc $rc) in $(($(date +%s) - t0)) s"
    env -u PYTHONPATH "$PY" "$HERE/report.py" step "$STATE" "$name" "$status" "$rc" "$(($(date +%s) - t0))" "$cap"
    collect
    [ "$status" = ok ]
}

main() {
    local steps=()
    while (($#)); do
        case $1 in
        --dry-run) DRY=1 ;;
        --budget) BUDGET=$2; shift ;;
        --one) shift; cd "$REPO" && "step_$1"; return ;;
        all) steps+=(install probe dropin tests bench-vgg16 bench-rest) ;;
        -h | --help) sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; return 0 ;;
        *)
            if [[ " $ORDER " != *" $1 "* ]]; then
                echo "verify: unknown step '$1' (steps: $ORDER all; --help says what each does)" >&2
                return 2
            fi
            steps+=("$1") ;;
        esac
        shift
    done
    ((${#steps[@]})) || { echo "verify: name the steps to run (steps: $ORDER all; --help)" >&2; return 2; }
    START=$(date +%s)
    [ -n "$DRY" ] || mkdir -p "$STATE" "$LOGS" "$REPORT_DIR"
    local failed=0 s
    for s in "${steps[@]}"; do
        if ! run_step "$s"; then
            failed=1
            # Nothing after a failed stage or install can run: stop there, the report says why.
            case $s in stage | install) break ;; esac
        fi
    done
    if [ -z "$DRY" ]; then
        echo "== report: $REPORT_DIR"
        sed -n '/^## Figures/,$p' "$REPORT_DIR/report.md" 2>/dev/null
    fi
    return $failed
}

main "$@"
