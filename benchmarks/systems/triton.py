"""Triton Inference Server with its native ONNX Runtime backend, on CPU, holding more models than memory the way
KServe's ModelMesh drives it: `--model-control-mode=explicit`, nothing loaded at start, and a controller that
loads a model on its first call and unloads the least recently used idle models to stay in the budget.

The server is ../shared/peers/triton-native's (Triton 2.51 from the nvidia-pytriton wheel, the backend built
by its build.sh), started as its serve.sh starts it but over one repository of every function's model. Each
model's config sets only `backend: "onnxruntime"` and one CPU instance (Triton's default is 2 on CPU, each its
own session and copy of the weights: one is what a memory-bound deployment sets); the rest is Triton's
autocomplete (max_batch_size 4 with dynamic batching where the model allows it), ORT's defaults in the backend.

The controller's model sizes are ModelMesh's: a first estimate (the .onnx file's size times 2), replaced by
what loading it really kept (the box's working set before and after), the last such figure kept per model;
the 15 % of the budget it leaves free takes a load's transient (measured under jemalloc, its peak over what
it kept: ResNet-50 +93 MiB, ViT-B/16 +10 MiB). (A first version took the box's peak during the load: with
calls running beside it, that charged ViT-B/16 990 MiB and refused it at 1.5 GiB.) Triton runs with jemalloc preloaded where the machine has it, as
Triton's docs advise for loading and unloading models: measured here, glibc's malloc kept 1,152 MiB after
ResNet-50, SqueezeNet and ViT-B/16 were loaded and unloaded again.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

PEER = Path(__file__).resolve().parents[3] / "shared" / "peers" / "triton-native"
TMP = Path(os.environ.get("TMPDIR", "/tmp"))


def peer_paths() -> dict | None:
    """Where serve.sh finds Triton and the backend (its defaults), or None where the peer is not built here."""
    venv = Path(os.environ.get("PYT_VENV", TMP / "pyt-venv"))
    backends = Path(os.environ.get("BACKENDS", TMP / "triton-native" / "backends"))
    server = next(iter(venv.glob("lib/python3.12/site-packages/pytriton/tritonserver/bin/tritonserver")), None)
    py312 = os.environ.get("PY312") or next(iter(sorted(Path("/root/.pyenv/versions").glob("3.12*/bin/python3.12"))),
                                              None)
    if server is None or py312 is None or not (backends / "onnxruntime" / "libtriton_onnxruntime.so").exists():
        return None
    return {"server": server, "backends": backends, "pylib": Path(os.path.realpath(py312)).parents[1] / "lib"}


def jemalloc() -> str | None:
    """The allocator Triton's docs recommend where models are loaded and unloaded (model_management.md: glibc's
    malloc keeps what an unloaded model freed; its container ships tcmalloc and jemalloc for LD_PRELOAD):
    $TRITON_MALLOC, else Debian's libjemalloc2, else the copy Ray bundles; None where there is none."""
    import glob
    found = [os.environ.get("TRITON_MALLOC", ""), "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
             *glob.glob(str(Path(sys.prefix) / "lib/python3*/site-packages/ray/core/libjemalloc.so"))]
    return next((p for p in found if p and Path(p).is_file()), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_repository(repo: Path, models: dict[str, str]) -> None:
    """name -> .onnx path: Triton's repository layout, the model linked, a config of two settings."""
    for name, path in models.items():
        (repo / name / "1").mkdir(parents=True, exist_ok=True)
        link = repo / name / "1" / "model.onnx"
        if not link.exists():
            link.symlink_to(os.path.abspath(path))
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "onnxruntime"\ninstance_group [ {{ kind: KIND_CPU count: 1 }} ]\n')


def wait_server_ready(address: str, proc, what: str, log_name: str, timeout_s: float = 120) -> None:
    """Until the server at `address` (gRPC) says it is ready; RuntimeError, naming its log, if `proc` exits or
    `timeout_s` passes first."""
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(address)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with status {proc.returncode} (its log: {log_name})")
            try:
                if client.is_server_ready():
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s (its log: {log_name})")
    finally:
        client.close()


class TritonServer:
    """tritonserver in explicit model control over `repo`, started through `wrap` (the box)."""

    def __init__(self, repo: Path, wrap, log):
        paths = peer_paths()
        if paths is None:
            raise RuntimeError(f"no Triton peer built here: run {PEER}/build.sh (its README says how)")
        self.http, self.grpc = free_port(), free_port()
        env = {**os.environ, "LD_LIBRARY_PATH": f"{paths['backends'] / 'onnxruntime'}:{paths['pylib']}"}
        self.malloc = jemalloc()
        if self.malloc:
            env["LD_PRELOAD"] = self.malloc
        argv = [str(paths["server"]), f"--model-repository={repo}", "--model-control-mode=explicit",
                "--strict-readiness=true", f"--backend-directory={paths['backends']}",
                "--http-address=127.0.0.1", f"--http-port={self.http}", "--grpc-address=127.0.0.1",
                f"--grpc-port={self.grpc}", "--allow-metrics=false", "--allow-sagemaker=false",
                "--allow-vertex-ai=false", "--pinned-memory-pool-byte-size=0", "--cuda-memory-pool-byte-size=0:0",
                "--exit-timeout-secs=5", "--log-verbose=0"]
        self.proc = subprocess.Popen(wrap(argv), env=env, stdout=log, stderr=log, start_new_session=True)
        wait_server_ready(f"127.0.0.1:{self.grpc}", self.proc, "tritonserver", log.name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class LruController:
    """ModelMesh's policy over one Triton: `call(name, inputs)` loads `name` if it is not, first unloading the
    least recently used models with no call in flight until the estimate fits under `fill` of the budget (as
    modelcache's tier waits for room, a load waits while the models in the way are busy)."""

    def __init__(self, server: TritonServer, box, file_bytes: dict[str, int], fill: float = 0.85,
                 wait_s: float = 30.0):
        import tritonclient.grpc as grpcclient
        self.grpcclient, self.server, self.box, self.fill, self.wait_s = grpcclient, server, box, fill, wait_s
        self.file_bytes = file_bytes
        self.footprint: dict[str, int] = {}
        self.loaded: OrderedDict[str, None] = OrderedDict()   # least recently used first
        self.in_flight: dict[str, int] = {}
        self.loading: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.load_lock = threading.Lock()                      # one load at a time, as ModelMesh's per-server queue
        self.local = threading.local()
        self.loads = self.unloads = 0

    def client(self):
        if not hasattr(self.local, "client"):
            self.local.client = self.grpcclient.InferenceServerClient(f"127.0.0.1:{self.server.grpc}")
        return self.local.client

    def call(self, name: str, feeds: dict) -> dict:
        cold = self._acquire(name)
        try:
            inputs = []
            for k, v in feeds.items():
                i = self.grpcclient.InferInput(k, list(v.shape), {"float32": "FP32", "int64": "INT64",
                                                                  "float16": "FP16", "bool": "BOOL"}[str(v.dtype)])
                i.set_data_from_numpy(v)
                inputs.append(i)
            self.client().infer(name, inputs, client_timeout=120)
        finally:
            with self.lock:
                self.in_flight[name] -= 1
        return {"cold": cold}

    def _acquire(self, name: str) -> bool:
        """Make `name` loaded and count a call in flight on it; True where the call waited for a load."""
        with self.lock:
            if name in self.loaded:
                self.loaded.move_to_end(name)
                self.in_flight[name] = self.in_flight.get(name, 0) + 1
                return False
            event = self.loading.get(name)
            mine = event is None
            if mine:
                event = self.loading[name] = threading.Event()
        if mine:
            try:
                self._load(name)
            finally:
                with self.lock:
                    self.loading.pop(name).set()
        else:
            event.wait()
        with self.lock:
            if name not in self.loaded:
                raise RuntimeError(f"Triton could not load {name} (see the load that failed)")
            self.loaded.move_to_end(name)
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
        return True

    def _load(self, name: str) -> None:
        """Unload idle models, least recently used first, until `name`'s estimate fits; while the models left
        are busy, wait for their calls to end (up to `wait_s`); a model that cannot fit even alone is refused,
        rather than loaded for the OOM killer to end the server (ModelMesh does not place it either)."""
        with self.load_lock:
            need = self.footprint.get(name, 2 * self.file_bytes[name])
            deadline = time.monotonic() + self.wait_s
            while self.box.working_set() + need > self.fill * self.box.budget:
                with self.lock:
                    victim = next((m for m in self.loaded if not self.in_flight.get(m)), None)
                    if victim is not None:
                        del self.loaded[victim]
                    busy = bool(self.loaded)
                if victim is not None:
                    self._unload(victim)
                elif not busy:
                    raise RuntimeError(f"{name} needs about {need >> 20} MiB, more than the budget holds beside "
                                       f"Triton ({self.box.working_set() >> 20} MiB of {self.box.budget >> 20} in use)")
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: waited {self.wait_s:.0f} s for the models in use to go idle")
                else:
                    time.sleep(0.02)
            before = self.box.working_set()
            self.client().load_model(name, client_timeout=120)
            self.loads += 1
            self.footprint[name] = max(self.box.working_set() - before, self.file_bytes[name])
            with self.lock:
                self.loaded[name] = None

    def _unload(self, name: str) -> None:
        """Unload and wait until Triton has (its unload can return before the model is gone)."""
        c = self.client()
        c.unload_model(name)
        self.unloads += 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            index = c.get_model_repository_index(as_json=True).get("models", [])
            if not any(m.get("name") == name and m.get("state") in ("READY", "UNLOADING") for m in index):
                return
            time.sleep(0.02)
