"""Workers: CPU groups (threads in the daemon, each pinned to its cores, each with its own ORT
thread pool) and one GPU worker per device of the daemon's GPU tier.

A worker only runs what the owner loop queued for it and posts the result back; it
owns its sessions (built on first use) and nothing else. A CPU worker's sessions map the
daemon's read-only host-tier segments, so stages share weights with every client.

A GPU worker is the same thread, queue and session cache, over the GPU tier's device
memory: the daemon's own process holds the arenas, so a stage's weights are OrtValues
over device pointers (DLPack, ``add_initializer`` on the stage's GPU skeleton, as an
attached client does over IPC) and no session copies them. The owner loop hands it each
tensor's address with the job and holds a lease on that device copy for as long as the
worker may have a session over it (see Engine). A stage whose output goes on to another
stage keeps it on the device (IOBinding), so consecutive stages on one GPU pass the
crossing tensor without a round trip through host memory. A fake device (``fake_gpus``)
is host memory standing in for device memory: the same calls, on ORT's CPU provider.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
from dataclasses import dataclass, field

from ..errors import InputError, ModelCacheError, RunError
from ..memlimit import release_freed_heap
from .scheduler import WorkerState

log = logging.getLogger("modelcache.executor")

# ORT's severity levels: 0 verbose ... 3 error, 4 fatal. Its logger writes a failed run's error to stderr (in
# ANSI colours) as well as raising it; the error reaches the caller as ours, so the daemon's log keeps only that.
ORT_LOG_FATAL_ONLY = 4
_ORT_ERRORS_MODULE = "onnxruntime.capi.onnxruntime_pybind11_state"
_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_NODE = re.compile(r"Non-zero status code returned while running (\S+) node\. Name:'([^']*)' Status Message: ")


def stage_error(model_key: str, stage: int, error: Exception) -> ModelCacheError:
    """The typed error of a failed stage run. ORT says whose fault by its status: INVALID_ARGUMENT is the
    request's data (an index out of a Gather's range, a dtype) -> InputError, which the caller can fix; any
    other failure (FAIL, RUNTIME_EXCEPTION, a Python error here) -> RunError: the same request fails again."""
    if isinstance(error, ModelCacheError):
        return error
    text = str(error)[:500]
    if type(error).__module__ == _ORT_ERRORS_MODULE:
        detail = _ORT_NODE.sub(lambda m: f"{m[1]} node {m[2]!r}: " if m[2] else f"{m[1]} node: ",
                               _ORT_PREFIX.sub("", text))
        if type(error).__name__ == "InvalidArgument":
            return InputError(f"{model_key} refused the input (stage {stage}): {detail}")
        return RunError(f"{model_key}: stage {stage} failed: {detail}")
    return RunError(f"{model_key}: stage {stage} failed: {type(error).__name__}: {text}")


def quiet_session_options(so):
    """A stage session's options: ORT logs nothing below fatal (see ORT_LOG_FATAL_ONLY)."""
    so.log_severity_level = ORT_LOG_FATAL_ONLY
    return so


def parse_groups(spec: str, cpus: list[int] | None = None) -> list[list[int]]:
    """'1,1' -> [[0], [1]]; '2' -> [[0, 1]]: consecutive cores of this process's CPU set per group."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    sizes = [int(x) for x in str(spec).split(",") if x.strip()]
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"workers={spec!r}: give thread counts per group, e.g. '1,1' or '2'")
    groups, at = [], 0
    for n in sizes:
        # More groups than cores: wrap around (groups share cores; still correct, just slower).
        groups.append([cpus[(at + i) % len(cpus)] for i in range(n)])
        at += n
    return groups


INLINE = "inline"   # a session key's third part: the stage's single-threaded session, for inline runs


@dataclass
class StageJob:
    batch_id: int
    model_key: str
    stage: int
    skeleton: str              # stage skeleton (its external data names files that exist; ORT checks)
    segments: list             # host-tier segment paths
    tensors: list              # [name, dtype, shape, segment index, offset, nbytes] the stage needs
    inputs: dict               # name -> array
    outputs: list
    predicted_s: float | None
    queued_at: float = 0.0
    worker_id: int = -1            # set by the worker that runs it
    result: dict = field(default_factory=dict)
    session: "StageSession | None" = None   # held from can_run_inline to the end of the inline run
    # For a GPU worker: {"uuid", "skeleton" (the stage's GPU skeleton), "tensors": [[name, dtype, shape,
    # address in this process, nbytes]]} of the device copy it runs over; None on a CPU worker.
    device: dict | None = None
    keep_on_device: bool = False   # a later stage reads the outputs: a GPU worker leaves them on its device
    # The engine predicts it short enough to run inline (it did not only because something else was in flight,
    # or the worker has no inline session yet): the worker builds the stage's inline session after the run.
    short: bool = False
    threads: int = 0               # the model's own intra-op thread count (its Triton config's); 0: the worker's cores


@dataclass
class WorkerCall:
    """Work other than a stage for a worker's thread (a profile: Worker.profile): work(worker) runs there, in
    its turn after the jobs queued before it, and done(result, error) is called on that thread after."""
    work: object
    done: object


class DeviceValue:
    """A stage output left on a GPU worker's device (an OrtValue there) for the next stage to bind in place.

    What the engine needs of an array (shape, ndim, nbytes) without copying it; `numpy()` brings it to
    host memory, which a CPU worker, a batch merge or the answer does first (`to_host`)."""

    __slots__ = ("value", "device", "shape", "nbytes")
    _ITEMSIZE = {"float": 4, "float16": 2, "double": 8, "bfloat16": 2, "int8": 1, "uint8": 1, "int16": 2,
                 "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1}

    def __init__(self, value, device: str):
        self.value, self.device = value, device
        self.shape = tuple(value.shape())
        kind = value.data_type()[len("tensor("):-1]
        n = 1
        for d in self.shape:
            n *= d
        self.nbytes = n * self._ITEMSIZE.get(kind, 4)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numpy(self):
        return self.value.numpy()

    def __repr__(self) -> str:
        return f"DeviceValue({self.shape} on {self.device})"


def to_host(value):
    """An array in host memory: a DeviceValue copied out, anything else as it is."""
    return value.numpy() if isinstance(value, DeviceValue) else value


class StageSession:
    """A stage's ORT session with the weight mappings it runs on.

    ORT keeps raw pointers into the mappings (through `values`, added as initializers), so they
    must live as long as the session is used: whoever runs the session holds this whole object,
    not just the session, and a drop only forgets the worker's reference. The mappings close when
    the last holder lets go, which is never during a run (an unmapped weight under a run was a
    SIGSEGV: eviction dropped a session on the worker's thread while the owner loop ran it inline).
    """

    __slots__ = ("session", "maps", "values")

    def __init__(self, session, maps: list, values: list):
        self.session, self.maps, self.values = session, maps, values


class WorkerUnavailable(ModelCacheError):
    """The worker cannot run stages at all (its device would not start): the engine places no more
    stages on it and runs this one elsewhere."""


def _gpus_off(spec: str) -> bool:
    return str(spec).strip().lower() in ("none", "", "off")


def select_gpus(spec: str, devices: list, cuda_provider: bool) -> list:
    """The devices that get a GPU worker. spec: "auto" (every device, when onnxruntime has the CUDA
    execution provider), "none", or device indices "0,1" (each must exist, and the provider too)."""
    if _gpus_off(spec):
        return []
    spec = str(spec).strip().lower()
    if spec == "auto":
        if devices and not cuda_provider:
            log.warning("%d CUDA device(s) but onnxruntime has no CUDAExecutionProvider: serving on CPU only "
                        "(install onnxruntime-gpu, the [gpu] extra)", len(devices))
        return list(devices) if cuda_provider else []
    try:
        wanted = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"gpus={spec!r}: give 'auto', 'none' or device indices such as '0,1'") from None
    by_index = {d.index: d for d in devices}
    for i in wanted:
        if i not in by_index:
            seen = ", ".join(str(d.index) for d in devices) or "none"
            raise ValueError(f"gpus={spec!r}: there is no CUDA device {i} (devices here: {seen})")
    if wanted and not cuda_provider:
        raise ValueError(f"gpus={spec!r}: onnxruntime has no CUDAExecutionProvider; install onnxruntime-gpu "
                         "(the [gpu] extra), or set gpus=none")
    return [by_index[i] for i in wanted]


def discover_gpus(spec: str) -> list:
    """select_gpus over this machine's devices; onnxruntime is asked only when a device exists."""
    from ..tiers import gpu

    devices = [] if _gpus_off(spec) else gpu.probe()
    cuda_provider = False
    if devices:
        import onnxruntime as ort
        cuda_provider = "CUDAExecutionProvider" in ort.get_available_providers()
    return select_gpus(spec, devices, cuda_provider)


class Worker:
    """A CPU worker group."""

    def __init__(self, worker_id: int, cores: list[int], post):
        self.state = WorkerState(worker_id, kind=f"cpu{len(cores)}")
        self.cores = cores
        self.queue: queue.Queue = queue.Queue()
        self.post = post                        # post(job, error): hands the finished job to the owner loop
        # (model key, stage) -> StageSession. Only this worker's thread adds or removes entries; the owner
        # loop reads them (can_run_inline), each with one lookup.
        self.sessions: dict = {}
        # Drops of a model's sessions: sent (by the owner loop) and done (by this thread), one writer each.
        # Until its drops are done a model's sessions may be stale (a new partition), so none runs inline.
        self.drops_sent: dict = {}
        self.drops_done: dict = {}
        self.queued_predictions: list = []      # owner-side: predicted seconds of jobs not yet finished
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=f"worker-{worker_id}", daemon=True)

    @property
    def name(self) -> str:
        """How a system description names this worker (`modelcache place --describe`)."""
        return f"cpu-{self.state.worker_id}"

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True             # a profile in progress starts no more runs (Worker.profile)
        self.queue.put(None)
        self.thread.join(timeout=30)

    def drop_model(self, model_key: str, then=None) -> None:
        """Forget sessions of an evicted model (they map segments that are being freed). Through the
        queue, so jobs queued before the drop still find them; a run in progress, on this thread or
        inline on the owner loop, holds its StageSession and finishes on it. `then()` runs on this
        thread once the sessions are gone (a GPU worker's lease on the device copy is released then)."""
        self.drops_sent[model_key] = n = self.drops_sent.get(model_key, 0) + 1
        self.queue.put(("drop", model_key, then, n))

    def _pin(self) -> None:
        try:
            os.sched_setaffinity(0, self.cores)  # this thread; ORT's pool threads, created here, inherit it
        except OSError as e:
            log.warning("worker %d: cannot pin to cores %s: %s", self.state.worker_id, self.cores, e)

    def _loop(self) -> None:
        self._pin()
        while True:
            job = None   # (not kept while waiting: a request's inputs may map a client's memory file until it goes)
            job = self.queue.get()
            if job is None:
                self.sessions.clear()
                return
            if isinstance(job, WorkerCall):
                try:
                    result, error = job.work(self), None
                except Exception as e:    # a bad input or an ORT failure costs that call, never the worker
                    # Without its traceback, which holds the failed call's frames (a profile's session) until
                    # the owner loop is done with the error.
                    result, error = None, e.with_traceback(None)
                job.done(result, error)
                continue
            if isinstance(job, tuple):
                _, model_key, then, n = job
                dropped = [k for k in self.sessions if k[0] == model_key]
                for key in dropped:
                    del self.sessions[key]
                if dropped:   # their arenas and buffers, freed, would stay resident as glibc's heap
                    release_freed_heap()
                self.drops_done[model_key] = n
                if then is not None:
                    then()
                continue
            error = self.run(job)
            self.post(job, error)
            if job.short and error is None:
                self._inline_session(job)

    def run(self, job: StageJob) -> Exception | None:
        """Run one stage job; its outputs and time go into job.result. Returns the error, if any:
        a bad input or an ORT failure costs that request, never the worker."""
        job.worker_id = self.state.worker_id
        try:
            # `stage` holds the session and its mappings until this run returns, whatever drops it meanwhile.
            stage = job.session or self._session(job)
            t0 = time.perf_counter()
            outputs = self._run_session(stage, job)
            job.result = {"outputs": outputs, "run_s": time.perf_counter() - t0}
            return None
        except Exception as e:
            return e
        finally:
            job.session = None   # a dropped session is freed now, not when the job is

    def can_run_inline(self, job: StageJob) -> bool:
        """Whether the owner loop may run this job itself (see Engine._run_inline): only once this
        worker built the stage's session, since building one takes far too long for the loop.

        When it may, the job takes the session now: the worker's thread may drop it (eviction)
        before or while the loop runs the job, and the loop must neither build one nor lose the
        mappings under a run."""
        if self.drops_done.get(job.model_key, 0) != self.drops_sent.get(job.model_key, 0):
            return False   # a drop is on its way to this thread: the session found now may be stale
        job.session = self.sessions.get((job.model_key, job.stage) if self._single_threaded(job) else
                                        (job.model_key, job.stage, INLINE))
        return job.session is not None

    def _inline_session(self, job: StageJob) -> None:
        """Build the stage's inline session if it has none: the same stage over the same mapped weights, with
        one intra-op thread. A stage runs inline only when it is short and nothing else is in flight; then the
        group's other threads have nothing to do that pays for waking them: before this session, one 1-core group
        served tiny-cnn with less daemon CPU a request than one group of both cores; with it, no difference is
        left (benchmarks/grpc/NOTES.md, `onecore/`). A 1-core group's own session is its inline session already.
        Only on this worker's thread; a failure leaves the stage running on this thread, as before."""
        key = (job.model_key, job.stage, INLINE)
        if self._single_threaded(job) or key in self.sessions or (job.model_key, job.stage) not in self.sessions:
            return
        try:
            self.sessions[key] = self._build_session(job, threads=1)
        except Exception as e:
            log.warning("%s stage %d: no single-threaded session to run inline: %s", job.model_key, job.stage, e)

    def _session(self, job: StageJob) -> StageSession:
        """The stage's session, built on first use: on the worker's cores, or as many threads as the model's own
        intra-op thread count where it has one (fewer leave the others' cores to the rest of the machine: the
        fronts, the clients). Only on this worker's thread."""
        key = (job.model_key, job.stage)
        stage = self.sessions.get(key)
        if stage is None:
            threads = max(1, len(self.cores))
            stage = self.sessions[key] = self._build_session(job, threads=min(threads, job.threads or threads))
        return stage

    def _single_threaded(self, job: StageJob) -> bool:
        """Whether the stage's own session runs on one thread: then it is its inline session as well."""
        return len(self.cores) <= 1 or job.threads == 1

    def _build_session(self, job: StageJob, threads: int) -> StageSession:
        import onnxruntime as ort
        from ..session_options import attach_session_options, bind_weights

        so = quiet_session_options(attach_session_options(spinning=False))
        so.intra_op_num_threads = threads
        maps, values = bind_weights(so, job.segments, job.tensors)
        sess = ort.InferenceSession(job.skeleton, so, providers=self._providers())
        self._check_session(sess)
        return StageSession(sess, maps, values)

    def profile(self, skeleton: str, segments: list, tensors: list, feeds: dict, runs: int,
                min_s: float) -> tuple[dict, dict, list]:
        """ORT's profiler over a whole model as this worker runs its stages: on this thread and its cores, with
        its thread count, over the host tier's weights in this process (executor/profile.py's run_profiled:
        node times, args, cold runs' extra seconds). A session of its own, built and freed here: the
        worker's stage sessions are untouched.

        Why here and not in the planner's process: there the same runs came out 0-14 % faster than the
        daemon ran the model's stages (benchmarks/placement/check), which the plans' predictions carried."""
        import tempfile

        import onnxruntime as ort
        from ..wire.protocol import MAX_PROFILE_S
        from .profile import profiling_options, run_profiled
        from ..session_options import bind_weights

        with tempfile.TemporaryDirectory(prefix="modelcache-profile-") as tmp:
            so = quiet_session_options(profiling_options(max(1, len(self.cores)), tmp))
            maps, values = bind_weights(so, segments, tensors)   # held until the session is gone
            sess = ort.InferenceSession(skeleton, so, providers=["CPUExecutionProvider"])
            try:
                return run_profiled(sess, feeds, runs, min_s, max_s=MAX_PROFILE_S, should_stop=lambda: self.stopping)
            finally:
                del sess, values
                maps.clear()

    def _run_session(self, stage: StageSession, job: StageJob) -> dict:
        inputs = job.inputs
        if any(isinstance(v, DeviceValue) for v in inputs.values()):   # the previous stage ran on a GPU
            inputs = {k: to_host(v) for k, v in inputs.items()}
        return dict(zip(job.outputs, stage.session.run(job.outputs, inputs)))

    def _providers(self) -> list:
        return ["CPUExecutionProvider"]

    def _check_session(self, sess) -> None:
        """A CPU session is always what was asked for."""


def gpu_kind(device) -> str:
    """Performance-model class of a device: its model name ('|' separates fields in the saved models)."""
    return "gpu:" + device.name.replace("|", "/")


class GpuWorker(Worker):
    """One per GPU-tier device; see the module's docstring for what runs where."""

    def __init__(self, worker_id: int, device, post):
        super().__init__(worker_id, [], post)
        self.device = device
        self.fake = device.uuid.startswith("fake-")     # host memory standing in for the device
        # Host inputs (a request's, a CPU stage's outputs) are copied to the device: dmda counts that
        # (memory_node); a previous stage's output on this device is not moved.
        self.state = WorkerState(worker_id, kind=gpu_kind(device), memory_node=device.uuid)
        self._preloaded = False

    @property
    def name(self) -> str:
        return f"gpu-{self.device.index}"

    def _pin(self) -> None:
        """Not pinned: its CPU work is launching kernels and copies, wherever the OS finds room."""

    def _providers(self) -> list:
        if self.fake:
            return ["CPUExecutionProvider"]
        return [("CUDAExecutionProvider", {"device_id": self.device.index}), "CPUExecutionProvider"]

    def _session(self, job: StageJob) -> StageSession:
        """The stage's session over the device copy's memory (job.device), built on first use. Only on
        this worker's thread. No weight is copied: each is an OrtValue over its arena address."""
        key = (job.model_key, job.stage)
        stage = self.sessions.get(key)
        if stage is not None:
            return stage
        if job.device is None or job.device.get("uuid") != self.device.uuid:
            # The engine places on a GPU worker only stages whose model is on its device.
            raise ModelCacheError(f"GPU worker {self.state.worker_id}: stage {job.stage} of {job.model_key} "
                                  f"came without its weights on device {self.device.uuid}")
        import onnxruntime as ort
        from ..cuda import KDL_CPU, KDL_CUDA, dlpack_value
        from ..session_options import attach_session_options

        if not self.fake and "CUDAExecutionProvider" not in ort.get_available_providers():
            raise WorkerUnavailable(f"GPU worker {self.state.worker_id}: onnxruntime {ort.__version__} has no CUDA "
                                    f"execution provider (install onnxruntime-gpu, the [gpu] extra)")
        if not self.fake and not self._preloaded:
            preload = getattr(ort, "preload_dlls", None)
            if preload is not None:
                preload()   # the CUDA and cuDNN libraries ORT's CUDA provider needs (shared/GPU.md)
            self._preloaded = True
        device_type, device_id = (KDL_CPU, 0) if self.fake else (KDL_CUDA, self.device.index)
        so = quiet_session_options(attach_session_options(spinning=False))
        so.intra_op_num_threads = 1
        values = []
        for name, dtype, shape, address, nbytes in job.device["tensors"]:
            value = dlpack_value(address, dtype, shape, device_type, device_id)
            if nbytes and value.data_ptr() != address:
                raise ModelCacheError(f"onnxruntime copied {name!r} of {job.model_key} instead of using the arena")
            values.append(value)
            so.add_initializer(name, value)
        sess = ort.InferenceSession(job.device["skeleton"], so, providers=self._providers())
        self._check_session(sess)
        stage = self.sessions[key] = StageSession(sess, [], values)
        return stage

    def _run_session(self, stage: StageSession, job: StageJob) -> dict:
        """Run with IOBinding: this device's values are bound in place, host arrays copied in; outputs stay
        on the device when a later stage reads them (job.keep_on_device), else come back to host memory."""
        import numpy as np

        io = stage.session.io_binding()
        for name, value in job.inputs.items():
            if isinstance(value, DeviceValue) and value.device == self.device.uuid:
                io.bind_ortvalue_input(name, value.value)
            else:
                io.bind_cpu_input(name, np.ascontiguousarray(to_host(value)))
        device, device_id = ("cpu", 0) if self.fake else ("cuda", self.device.index)
        for name in job.outputs:
            if job.keep_on_device:
                io.bind_output(name, device, device_id)
            else:
                io.bind_output(name, "cpu")
        stage.session.run_with_iobinding(io)
        values = io.get_outputs()
        if job.keep_on_device:
            return {name: DeviceValue(v, self.device.uuid) for name, v in zip(job.outputs, values)}
        return {name: v.numpy() for name, v in zip(job.outputs, values)}

    def _check_session(self, sess) -> None:
        # ORT falls back to the CPU, with only a warning, when the CUDA provider cannot start (no
        # driver, a missing CUDA or cuDNN library): a GPU worker that silently ran on the CPU would
        # corrupt its performance models and the placements. Provider start does not depend on the
        # model, so this worker is done for.
        if self.fake:
            return
        if sess.get_providers()[0] != "CUDAExecutionProvider":
            raise WorkerUnavailable(f"GPU worker {self.state.worker_id}: onnxruntime could not start the CUDA "
                                    f"execution provider on device {self.device.index} ({self.device.name}); "
                                    f"it offers {sess.get_providers()}")
