"""What the GPU machine is and what runs there: for verify.sh's install and probe steps.

    python3 probe.py --installed SITE   after install: onnxruntime comes from SITE and has the CUDA provider,
                                        pyzmq imports; else one line saying which, and exit 1
    python3 probe.py --out DEVICE_JSON  the device (nvidia-smi), driver, CUDA, python, onnxruntime, cupy, and
                                        whether a 1-node session really runs on the CUDA provider: with CUDA's
                                        lazy module loading (the default), and in a child with
                                        CUDA_MODULE_LOADING=EAGER, which loads every fatbin of the compacted
                                        CUDA provider library at once (informational: 9 of its 609 fatbins hold
                                        sm_120a code only, in the original too)
Exit 1 when the session does not run on CUDA: the kit's compacted library failed on this GPU, and verify.sh
skips every step that needs it (the FALLBACK: the tier stage's results, which need no onnxruntime-gpu, are
what the session has; carrying the uncompacted library, 185 MiB packed, takes more calls than a session has).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def nvidia_smi() -> dict:
    fields = ["name", "uuid", "driver_version", "memory.total", "compute_cap"]
    r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=30)
    gpus = [dict(zip(fields, (v.strip() for v in line.split(",")))) for line in r.stdout.splitlines() if line.strip()]
    banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", banner)
    return {"gpus": gpus, "cuda_driver_api": cuda.group(1) if cuda else None,
            "error": r.stderr.strip() or None if r.returncode else None}


def one_node_session(ort) -> dict:
    """A Relu on CUDA: ORT lists its CUDA provider even where the CUDA or cuDNN libraries are missing, and
    falls back to the CPU with only a warning, so the session's own provider list is the check."""
    from onnx import TensorProto, helper, save
    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8     # a newer onnx writes an IR version onnxruntime 1.31 refuses (14 > 13)
        save(model, f"{tmp}/relu.onnx")
        t0 = time.perf_counter()
        sess = ort.InferenceSession(f"{tmp}/relu.onnx", providers=["CUDAExecutionProvider"])
        y = sess.run(None, {"x": np.array([-1, 0, 1, 2], np.float32)})[0]
        return {"providers": sess.get_providers(), "seconds": time.perf_counter() - t0,
                "correct": y.tolist() == [0, 0, 1, 2]}


def session_info() -> dict:
    """onnxruntime's version, providers and a 1-node session on CUDA; the error where one was raised."""
    try:
        import onnxruntime as ort
        t0 = time.perf_counter()
        ort.preload_dlls()
        out = {"version": ort.__version__, "file": ort.__file__, "preload_s": time.perf_counter() - t0,
               "available_providers": ort.get_available_providers(),
               "module_loading": os.environ.get("CUDA_MODULE_LOADING", "(default: LAZY)")}
        out["session"] = one_node_session(ort)
        return out
    except Exception as e:   # what failed is the finding: keep it in the report
        return {"error": f"{type(e).__name__}: {e}"}


def verdict(ort_info: dict) -> dict:
    """Whether the CUDA provider ran the session (providers[0] is CUDA and the output is right); else why, and
    the fallback."""
    session = ort_info.get("session") or {}
    ok = (session.get("providers") or [None])[0] == "CUDAExecutionProvider" and bool(session.get("correct"))
    eager = (ort_info.get("eager_loading") or {}).get("session") or {}
    why = None if ok else (ort_info.get("error") or f"the session ran on {session.get('providers')}, "
                                                    f"correct={session.get('correct')}")
    return {"ok": ok, "eager_ok": (eager.get("providers") or [None])[0] == "CUDAExecutionProvider"
            and bool(eager.get("correct")), "why": why,
            "fallback": None if ok else "the compacted CUDA provider did not run here: the steps that need it are "
                                        "skipped; the tier stage's results (no onnxruntime-gpu) stand"}


def versions() -> dict:
    from importlib import metadata
    out = {}
    for dist in ("onnxruntime-gpu", "onnxruntime", "pyzmq", "cupy-cuda13x", "numpy", "onnx", "msgpack", "psutil",
                 "xxhash", "cuda-bindings", "nvidia-cudnn-cu13", "nvidia-cuda-runtime", "torch"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def probe() -> dict:
    info = {"python": platform.python_version(), "host": platform.node(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                                  time.gmtime())}
    repo = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    info["commit"] = head.stdout.strip() if head.returncode == 0 else None   # the copy there may hold no .git
    try:
        info["nvidia_smi"] = nvidia_smi()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = {"gpus": [], "error": str(e)}
    info["packages"] = versions()
    info["onnxruntime"] = session_info()
    eager = subprocess.run([sys.executable, __file__, "--session"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CUDA_MODULE_LOADING": "EAGER"})
    try:
        info["onnxruntime"]["eager_loading"] = json.loads(eager.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        info["onnxruntime"]["eager_loading"] = {"error": f"rc {eager.returncode}: {eager.stderr.strip()[-800:]}"}
    info["cuda_ep"] = verdict(info["onnxruntime"])
    try:
        from cupy.cuda import runtime
        props = runtime.getDeviceProperties(0)
        info["cupy"] = {"devices": runtime.getDeviceCount(), "name": props["name"].decode(),
                        "runtime_version": runtime.runtimeGetVersion(), "driver_version": runtime.driverGetVersion()}
    except Exception as e:
        info["cupy"] = {"error": f"{type(e).__name__}: {e}"}
    return info


def check_installed(site: Path) -> int:
    import onnxruntime as ort
    import zmq
    where = Path(ort.__file__).resolve()
    print(f"onnxruntime {ort.__version__} from {where.parent}; providers {ort.get_available_providers()}; "
          f"pyzmq {zmq.__version__}")
    if site.resolve() not in where.parents:
        print(f"probe: onnxruntime is imported from {where.parent}, not from {site}: PYTHONPATH must put {site} "
              "before the image's site-packages", file=sys.stderr)
        return 1
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(f"probe: onnxruntime {ort.__version__} from {site} has no CUDAExecutionProvider: the carried wheel is "
              "not onnxruntime-gpu", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--installed", type=Path, help="check the packages installed into this --target folder")
    ap.add_argument("--out", type=Path, help="write the device description here (JSON)")
    ap.add_argument("--session", action="store_true", help="only the onnxruntime part, as one JSON line")
    args = ap.parse_args(argv)
    if args.session:
        print(json.dumps(session_info()))
        return 0
    if args.installed:
        return check_installed(args.installed)
    info = probe()
    text = json.dumps(info, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    if not info["cuda_ep"]["ok"]:
        print(f"probe: {info['cuda_ep']['why']}; FALLBACK: {info['cuda_ep']['fallback']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
