"""Every message between clients and the daemon: typed, versioned, declared here and nowhere else.

On the wire a message is two ZeroMQ frames: its kind (ASCII) and a msgpack map of its
fields. A receiver decodes into the type it expects and rejects anything else with a
ProtocolError. Messages evolve by adding fields at the end, with defaults; unknown
fields are ignored so that an older daemon still understands a newer client.
"""

from __future__ import annotations

from typing import Any, Optional  # noqa: F401  (named in the string annotations below)

import msgpack

from ..calibration import check_profile, check_serving
from ..errors import ProtocolError, RecordError
from .lane import MAX_FDS

PROTOCOL_VERSION = 1

MESSAGES: dict[bytes, type] = {}
_REQUIRED = object()
# Annotation text -> the Python types a msgpack value may decode to (a bool is an int to
# Python, so bool is accepted only where it is named).
_ACCEPT = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list, tuple),
           "dict": (dict,)}


def _fresh(default):
    """A default for one message: a list or dict default is copied, never shared between messages."""
    return list(default) if type(default) is list else dict(default) if type(default) is dict else default


def _base(annotation: str) -> str:
    return annotation[len("Optional["):-1] if annotation.startswith("Optional[") else annotation


class Message:
    """A typed message: fields come from the class annotations, defaults from class attributes.

    Hand-rolled rather than @dataclass: dataclasses generate code with exec() per class,
    which cost ~20 ms of every client's start-up, the very thing modelcache exists to cut.
    """

    KIND = b""
    FIELDS: tuple = ()        # (name, annotation text, default or _REQUIRED) per field, in order
    __slots__ = ()

    def __init_subclass__(cls, kind: str = "", **kw):
        super().__init_subclass__(**kw)
        fields = []
        for name, annotation in cls.__dict__.get("__annotations__", {}).items():
            default = cls.__dict__.get(name, _REQUIRED)
            fields.append((name, annotation if isinstance(annotation, str) else annotation.__name__, default))
        cls.FIELDS = tuple(fields)
        # (name, type text, accepted types, may be None, default) per field: decode checks every
        # field of every message, so the annotation text is read here once rather than per message.
        cls.CHECKS = tuple((name, _base(annotation), _ACCEPT[_base(annotation)], annotation.startswith("Optional["),
                            default) for name, annotation, default in fields)
        cls.KIND = kind.encode()
        MESSAGES[cls.KIND] = cls

    def __init__(self, **values):
        for name, _, default in self.FIELDS:
            if name in values:
                value = values.pop(name)
            elif default is _REQUIRED:
                raise TypeError(f"{type(self).__name__} needs {name!r}")
            else:
                value = _fresh(default)
            setattr(self, name, value)
        if values:
            raise TypeError(f"{type(self).__name__} has no field {next(iter(values))!r}")

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name, _, _ in self.FIELDS}

    def __eq__(self, other):
        return type(other) is type(self) and other.to_dict() == self.to_dict()

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"


# -- nested records ----------------------------------------------------------------------------

# Bytes per element of the types a weight tensor may have (numpy's names): a placement's byte count
# and alignment are checked against them; a type not listed here is checked for shape only.
ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "uint64": 8, "int32": 4,
              "uint32": 4, "int16": 2, "uint16": 2, "int8": 1, "uint8": 1, "bool": 1}


class TensorPlacement(tuple):
    """Where one weight tensor of an OpenReply lies. On the wire the positional row it always was,
    [name, dtype, shape, index, offset, nbytes] (index: of the segment, host tier; of the IPC handle, GPU);
    decoded into this, checked, so that no consumer re-validates it."""
    __slots__ = ()
    name = property(lambda self: self[0])
    dtype = property(lambda self: self[1])
    shape = property(lambda self: self[2])
    index = property(lambda self: self[3])
    offset = property(lambda self: self[4])
    nbytes = property(lambda self: self[5])

    @classmethod
    def from_wire(cls, row, n_indices: int | None = None) -> "TensorPlacement":
        """The checked record; ProtocolError says what is wrong. n_indices: how many segments or handles
        the index may name."""
        if isinstance(row, cls) and n_indices is None:
            return row
        if not isinstance(row, (list, tuple)) or len(row) != 6:
            raise ProtocolError(f"malformed tensor placement {row!r:.120}: expected [name, dtype, shape, index, "
                                "offset, nbytes]")
        name, dtype, shape, index, offset, nbytes = row
        elements = 1
        try:   # (written out, not any(...): this runs for every tensor of every open)
            if type(name) is not str or type(dtype) is not str or type(index) is not int or index < 0 \
                    or type(offset) is not int or offset < 0 or type(nbytes) is not int or nbytes < 0:
                raise TypeError
            for d in shape:
                if type(d) is not int or d < 0:
                    raise TypeError
                elements *= d
        except TypeError:
            raise ProtocolError(f"malformed tensor placement {row!r:.120}: expected [name, dtype, shape, index, "
                                "offset, nbytes] with non-negative integers") from None
        size = ITEM_BYTES.get(dtype)
        if size is not None:
            if elements * size != nbytes:
                raise ProtocolError(f"tensor {name!r}: shape {list(shape)} of {dtype} is not {nbytes} bytes")
            if offset % size:
                raise ProtocolError(f"tensor {name!r}: offset {offset} is not aligned to its {dtype} elements")
        if n_indices is not None and index >= n_indices:
            raise ProtocolError(f"tensor {name!r}: handle index {index} out of range ({n_indices} handles)")
        return cls(row)


class BatchingProfile(dict):
    """A model's batching calibration (calibration.py makes it, `modelcache calibrate` sends it), decoded and
    checked in full: every field's type, shape and range. Whether its stage count is the model's is for the
    daemon, which knows the model."""

    @classmethod
    def from_wire(cls, value) -> "BatchingProfile":
        try:
            check_profile(value)
        except ValueError as e:
            raise RecordError(str(e)) from None
        return cls(value)

    @property
    def stages(self) -> int:
        return len(self["stage_s"][0])


class PlacementPlan(dict):
    """A placement plan (`modelcache place`, placement/plan.py's to_json), decoded and checked: stages that are
    contiguous node ranges, worker names that are strings. Whether it fits the model's graph and the daemon's
    workers is for the daemon."""

    @classmethod
    def from_wire(cls, value) -> "PlacementPlan":
        if not isinstance(value, dict):
            raise RecordError("a placement plan is a map, as `modelcache place` writes it")
        nodes, stages = value.get("nodes"), value.get("stages")
        if type(nodes) is not int or nodes < 1:
            raise RecordError("the plan's nodes must be the model's node count, a whole number >= 1")
        if not isinstance(stages, list) or not 1 <= len(stages) <= nodes:
            raise RecordError(f"the plan's stages must be a list of 1 to {nodes} stages")
        if not isinstance(value.get("model", ""), str):
            raise RecordError("the plan's model must be a name")
        end = 0
        for k, stage in enumerate(stages):
            if not isinstance(stage, dict):
                raise RecordError(f"the plan's stage {k} is not a map")
            start, stop = stage.get("start"), stage.get("end")
            if type(start) is not int or type(stop) is not int or start != end or not start < stop <= nodes:
                raise RecordError(f"the plan's stage {k}: start and end must continue the node ranges "
                                  f"(start {end}, start < end <= {nodes})")
            end = stop
            names = stage.get("worker_names", [])
            if not isinstance(names, list) or not all(type(n) is str for n in names):
                raise RecordError(f"the plan's stage {k}: worker_names must be a list of worker names")
            for key in ("first_node", "last_node"):
                if type(stage.get(key, "")) is not str:
                    raise RecordError(f"the plan's stage {k}: {key} must be a node name")
        return cls(value)


def _ms(value) -> bool:
    return type(value) in (int, float) and value >= 0


class StageTiming(dict):
    """One stage of a served request: {stage, worker, kind, batch, wait_ms, run_ms, inline, predicted_ms}."""

    @classmethod
    def from_wire(cls, value) -> "StageTiming":
        if not isinstance(value, dict) or type(value.get("stage")) is not int or not _ms(value.get("wait_ms")) \
                or not _ms(value.get("run_ms")):
            raise ProtocolError(f"malformed stage timing {value!r:.120}: expected stage, wait_ms and run_ms")
        return cls(value)


class Timings(dict):
    """Where a served request's time went: queue_ms, total_ms and a StageTiming per stage run."""

    @classmethod
    def from_wire(cls, value) -> "Timings":
        if not isinstance(value, dict) or not isinstance(value.get("stages", []), list) \
                or any(k in value and not _ms(value[k]) for k in ("queue_ms", "total_ms")):
            raise ProtocolError(f"malformed timings {value!r:.120}: expected queue_ms, total_ms and stages")
        timings = cls(value)
        timings["stages"] = [StageTiming.from_wire(s) for s in value.get("stages", [])]
        return timings


# -- handshake and liveness ------------------------------------------------------------

class Hello(Message, kind="hello"):
    req_id: int
    protocol_version: int
    pid: int                           # for older daemons: this one takes the pid (and uid) from the kernel
    client_name: str = ""


class HelloReply(Message, kind="hello_ok"):
    req_id: int
    protocol_version: int
    daemon_version: str
    client_id: str
    heartbeat_interval_s: float
    lease_timeout_s: float


class Heartbeat(Message, kind="heartbeat"):
    """Fire and forget: keeps the client's leases alive."""
    client_id: str


class Goodbye(Message, kind="bye"):
    """The client is leaving: release all its leases now rather than at lease expiry."""
    req_id: int
    client_id: str


# -- models ------------------------------------------------------------------------------

class Open(Message, kind="open"):
    """On the lane, client_id "" needs no hello: the connection is the client, and its leases last as long
    as it does (client/leases.py). client_name names that client in `status`."""
    req_id: int
    client_id: str
    name: str
    version: Optional[int] = None
    device: str = "cpu"                # "cpu", or "cuda" / "cuda:<UUID>" for the model's copy on a GPU
    client_name: str = ""
    # How long the client waits for the answer: while the tier is full of models in use, the open waits for
    # room this long, then fails with CapacityError (None: the daemon's request_timeout_s).
    deadline_ms: Optional[float] = None
    # The client takes a host lease's files as descriptors (on the lane): the version's portable skeleton, then
    # each segment (store/portable.py). An older daemon ignores it; an older client never asks.
    descriptors: bool = False


class OpenReply(Message, kind="open_ok"):
    req_id: int
    lease_id: str
    name: str
    version: int
    skeleton_path: str                 # the weightless graph, in the host tier
    segments: list = []  # paths of the shared-memory segments clients map read-only
    tensors: list = []   # TensorPlacement each ([name, dtype, shape, segment index, offset, nbytes] on the wire)
    inputs: list = []    # [{name, dtype, shape}]
    outputs: list = []
    weights_bytes: int = 0
    hit: bool = True                   # was it resident (on the device asked for) before this open?
    # A GPU lease: skeleton_path is the GPU skeleton, tensors index ipc_handles instead of segments.
    device_uuid: str = ""              # the GPU whose memory the handles export ("" for the host tier)
    ipc_kind: str = ""                 # "cuda" (cudaIpcMemHandle_t), "fake" (a simulated device's file), or
                                       # "cuda-vmm" / "fake-vmm": fd-shared, read-only (ipc_fds below)
    ipc_handles: list = []             # one per device allocation the model's tensors live in
    # Host tier: the tensors whose pre-packed blobs the skeleton names (prepack.py). To share the blobs,
    # leave these out of add_initializer and build with prepacking on: ORT maps them from the skeleton.
    prepacked: list = []
    # File descriptors that came with this message on the lane (SCM_RIGHTS). A GPU lease: one per ipc_handle, in
    # their order, the allocations of the fd-shared kinds ("cuda-vmm", "fake-vmm"), whose handles only name them.
    # A host lease, to an Open that asked for `descriptors`: the portable skeleton, then one per segment, in
    # their order (or none: a version packed before portable skeletons, and its paths serve). The receiver's
    # copies are on `received_fds` (not a field: decoding sets it), the receiver's to close.
    ipc_fds: int = 0

    def _check_decoded(self) -> None:
        """Each tensor row a checked TensorPlacement, its index within the segments (host) or handles (GPU)."""
        n_indices = len(self.ipc_handles) if self.device_uuid else len(self.segments)
        self.tensors = [TensorPlacement.from_wire(row, n_indices) for row in self.tensors]
        if self.ipc_fds:
            expected, of = (len(self.ipc_handles), "handles") if self.device_uuid else \
                (1 + len(self.segments), "a skeleton and segments")
            if self.ipc_fds != expected:
                raise ProtocolError(f"open reply declares {self.ipc_fds} file descriptors for {expected} {of}")


class Close(Message, kind="close"):
    req_id: int
    client_id: str
    lease_id: str


class Ack(Message, kind="ok"):
    req_id: int


# Load, Pin and Evict answer Ack, or with outcome=True a ModelOutcome that says what was done: older
# clients expect Ack, and older daemons ignore the field and send it.

class Load(Message, kind="load"):
    """Prefetch a model into a tier without opening it; answered once it is resident there."""
    req_id: int
    name: str
    version: Optional[int] = None
    tier: str = "host"                 # "host", or "gpu" / "gpu:<UUID or index>" (through the host tier)
    outcome: bool = False


class Pin(Message, kind="pin"):
    """Pin (the eviction policy never chooses it) or unpin a model."""
    req_id: int
    name: str
    version: Optional[int] = None
    pinned: bool = True
    outcome: bool = False


class Remove(Message, kind="remove"):
    """Delete a model version from the repository (refused while in use)."""
    req_id: int
    name: str
    version: int


class AddEnsemble(Message, kind="add_ensemble"):
    """Add a Triton ensemble whose steps are models the daemon has (daemon/ensembles.py): `config` is its
    configuration as Triton's JSON (`platform: "ensemble"`, `ensemble_scheduling`, inputs and outputs)."""
    req_id: int
    name: str
    version: int
    config: dict


class Evict(Message, kind="evict"):
    """Drop a model from a tier now (refused while clients hold it there)."""
    req_id: int
    name: str
    version: Optional[int] = None
    tier: str = "host"                 # "host" frees every copy in memory; "gpu" / "gpu:<UUID or index>"
                                       # demotes it from the GPU(s) and keeps it in the host tier
    outcome: bool = False


class ModelOutcome(Message, kind="outcome_ok"):
    """What a load, pin or evict (with outcome=True) did to the version it resolved to: the memory tiers
    holding it before and after ("host", "gpu:<UUID>" each; none: on disk only), and whether it is pinned."""
    req_id: int
    name: str
    version: int
    before: list = []
    after: list = []
    freed_bytes: int = 0
    pinned: bool = False
    was_pinned: bool = False


class Verify(Message, kind="verify"):
    """Scrub the daemon's repository (every version of `name`, or of every model) against the checksums
    written at add time. A version found intact is served again if it was marked corrupt."""
    req_id: int
    name: Optional[str] = None


class VerifyReply(Message, kind="verify_ok"):
    req_id: int
    root: str                          # the repository scrubbed
    reports: list = []                 # per version: {key, status, problems, bytes_checked, seconds, cleared}


class ListModels(Message, kind="list"):
    req_id: int


class ModelList(Message, kind="list_ok"):
    req_id: int
    models: list = []   # dicts, see daemon.registry.ModelRecord.describe
    remote: str = ""    # the remote store's URL, whose models are fetched on first open ("": none)


class Add(Message, kind="add"):
    """Pack a model from the files whose descriptors come with this message over the lane (SCM_RIGHTS):
    `files` names them, the model's file name first, then its external-data files relative to it.
    `path` is where the client found the model, for messages only: the daemon never opens it."""
    req_id: int
    path: str
    name: str
    version: Optional[int] = None
    opt_level: Optional[str] = None
    files: list = []
    prepack: Optional[bool] = None     # None: the daemon's `prepack` setting
    serving: dict = {}                 # the model's own batching policy (calibration.check_serving)
    model_config: dict = {}            # the Triton model configuration it comes with (`modelcache import-triton`)
    labels: dict = {}                  # output -> its classes' labels, from the config's label_filename
    # The version is there already and this replaces it (a repository load of a changed file): packed beside it
    # while it serves, then swapped in at once; its opens and requests wait for the swap meanwhile (daemon/swaps.py)
    replace: bool = False

    def _check_decoded(self) -> None:
        check_declared(self)


def check_declared(msg) -> None:
    """What a model's source declares beside its file (Add's and Configure's serving, model_config, labels)."""
    try:
        check_serving(msg.serving)
    except ValueError as e:
        raise RecordError(str(e)) from None
    if not isinstance(msg.model_config, dict):
        raise RecordError("model_config must be a map (a Triton model configuration as JSON)")
    if not isinstance(msg.labels, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v)
            for k, v in msg.labels.items()):
        raise RecordError("labels must map output names to lists of strings")


class SetUnloaded(Message, kind="set_unloaded"):
    """Triton's explicit model control, one state for every front: a model (or ensemble) unloaded is not ready and
    its requests over the protocol fronts are refused until it is loaded again. The daemon keeps the names until it
    stops (as Triton's unloads last until its restart); the fronts read it in a model's description."""
    req_id: int
    name: str
    unloaded: bool = True


class Configure(Message, kind="configure"):
    """Replace what a stored version declares beside its file (Add's serving, model_config, labels), in place: its
    packed weights and files stay. A repository load whose configuration changed and whose file did not
    (triton_repo/load.py), as Triton reloads a model's configuration without reading its weights again."""
    req_id: int
    name: str
    version: int
    serving: dict = {}
    model_config: dict = {}
    labels: dict = {}

    def _check_decoded(self) -> None:
        check_declared(self)


class AddReply(Message, kind="add_ok"):
    req_id: int
    name: str
    version: int
    weights_bytes: int
    tensors: int
    pack_s: float


class Describe(Message, kind="describe"):
    req_id: int
    name: str
    version: Optional[int] = None


class DescribeReply(Message, kind="describe_ok"):
    req_id: int
    name: str
    version: int
    inputs: list = []
    outputs: list = []
    stages: list = []                  # [{file, inputs, outputs, cost_share}] when partitioned
    weights_bytes: int = 0
    model_config: dict = {}            # the Triton configuration it was imported with ({}: added otherwise)
    source_sha256: str = ""            # of the .onnx file it was packed from
    labels: dict = {}                  # output -> its classes' labels (label_filename; the classification extension)
    overridable: list = []             # initializers a request may feed in their place (Manifest.overridable)
    front_runs: dict = {}              # {max_batch} when a front may run it itself (Engine.front_may_run); {}: the engine
    response_cache: bool = False       # its answers may be cached (it asks, and the daemon's cache is on): a front
                                       # keeps its own (executor/response_cache.py)
    unloaded: bool = False             # a protocol front unloaded it (SetUnloaded): not ready there until loaded
    warming: bool = False              # its model_warmup runs now: not ready at the fronts, as Triton's while it warms


class SetBatching(Message, kind="set_batching"):
    """Store a model's batching calibration (`modelcache calibrate`) in its manifest."""
    req_id: int
    name: str
    version: Optional[int] = None
    profile: dict = {}                 # a BatchingProfile once decoded

    def _check_decoded(self) -> None:
        self.profile = BatchingProfile.from_wire(self.profile)


class Partition(Message, kind="partition"):
    """Split a model into sequential stages for serve mode (stages=1 undoes it)."""
    req_id: int
    name: str
    version: Optional[int] = None
    stages: Optional[int] = None
    tail_fraction: Optional[float] = None
    plan: Optional[dict] = None        # a placement plan (`modelcache place`): its cuts and worker sets;
                                       # a PlacementPlan once decoded

    def _check_decoded(self) -> None:
        if self.plan is not None:
            self.plan = PlacementPlan.from_wire(self.plan)


# A Profile's bounds: the daemon refuses more runs or a longer min_s, and its worker starts no profiled run
# after MAX_PROFILE_S (so a client waits that much beyond its usual timeout).
MAX_PROFILE_RUNS = 100
MAX_PROFILE_S = 60.0


class Profile(Message, kind="profile"):
    """Time every node of a model with ORT's profiler on one of the daemon's CPU workers: its thread, cores
    and thread count, over the host tier's weights, where serve mode runs the model's stages
    (`modelcache place` costs). The worker runs nothing else meanwhile. Inputs as in Infer."""
    req_id: int
    name: str
    inputs: list
    version: Optional[int] = None
    worker: Optional[str] = None       # a CPU worker's name (cpu-0, ...); None: the first
    runs: int = 3                      # at least this many back-to-back runs after one warm-up (a cold run between
    min_s: float = 1.0                 # each two), more until they span this long; none started after 60 s


class ProfileReply(Message, kind="profile_ok"):
    req_id: int
    name: str
    version: int
    worker: str
    threads: int
    times: dict = {}                   # node name -> seconds in each back-to-back run, the warm-up first
                                       # (kernel times scaled to the run's wall time)
    args: dict = {}                    # node name -> the profiler's op, shapes and sizes
    wake_s: list = []                  # per run after an idle spell, its extra seconds (executor/profile.py)


class Infer(Message, kind="infer"):
    """Serve mode: the daemon runs the model. Tensors as in modelcache.wire.tensors (inline or a shm file)."""
    req_id: int
    client_id: str
    name: str
    inputs: list
    version: Optional[int] = None
    output_names: Optional[list] = None
    deadline_ms: Optional[float] = None  # give up (with an error) if not done this long after arrival
    client_name: str = ""              # as Open's: names a lane connection's client (client_id "") in `status`
    # A stateful model's request (Triton's sequence batcher, executor/sequences.py): {"id": a uint64 or a
    # string, "start": bool, "end": bool}; ignored by a model without sequence batching, as Triton ignores it.
    sequence: Optional[dict] = None
    # Triton's request priority: the level it waits in where the model has priority levels (1 first; 0, None or one
    # above its levels: its default level, executor/queues.py); ignored by a model without them, as Triton ignores it.
    priority: Optional[int] = None
    # How many descriptors came with it over the lane: memory files its large inputs are in ({"fd": index}, or
    # {"fd_at": [index, offset]} for one in a received body: see wire/tensors.py). A daemon before them ignores the
    # field, and answers that a tensor has no "shm".
    ipc_fds: int = 0
    # How many of those (the last ones) are memory files lent for the answer's large outputs, which the daemon writes
    # into and names {"lent_at": [index, offset]} (wire/lent_outputs.py). A daemon before them maps them as inputs no
    # tensor names, and answers inline.
    lent_fds: int = 0

    def _check_decoded(self) -> None:
        if not 0 <= self.ipc_fds <= MAX_FDS:
            raise RecordError(f"ipc_fds {self.ipc_fds}: at most {MAX_FDS} descriptors travel with a message")
        if not 0 <= self.lent_fds <= self.ipc_fds:
            raise RecordError(f"lent_fds {self.lent_fds}: must be within 0..ipc_fds ({self.ipc_fds})")
        if self.priority is not None and not 0 <= self.priority <= UINT64_MAX:
            raise RecordError(f"priority {self.priority}: must be within 0..2^64-1")
        if self.sequence is not None:
            why = sequence_problem(self.sequence.get("id"), self.sequence.get("start"), self.sequence.get("end"))
            if why:
                raise RecordError(f"sequence: {why}")


UINT64_MAX = (1 << 64) - 1


def sequence_problem(seq_id, start, end) -> str | None:
    """Why a request's sequence is not one Triton takes (its id an unsigned 64-bit integer or a string, its start
    and end flags booleans), or None; the fronts say it of Triton's parameters, the daemon of an Infer's field."""
    if isinstance(seq_id, bool) or not (seq_id is None or isinstance(seq_id, (int, str))):
        return f"sequence_id {seq_id!r}: give an unsigned integer or a string"
    if isinstance(seq_id, int) and not 0 <= seq_id <= UINT64_MAX:
        return f"sequence_id {seq_id}: an integer id must be within 0..2^64-1"
    for what, flag in (("sequence_start", start), ("sequence_end", end)):
        if flag is not None and not isinstance(flag, bool):
            return f"{what} {flag!r}: give true or false"
    return None


class InferReply(Message, kind="infer_ok"):
    req_id: int
    outputs: list                      # tensors, inline
    timings: dict = {}                 # a Timings once decoded: queue_ms, total_ms, a StageTiming per stage
    version: Optional[int] = None      # the version that ran (an unversioned request gets the latest)

    def _check_decoded(self) -> None:
        self.timings = Timings.from_wire(self.timings)


class FrontServed(Message, kind="front_served"):
    """A front's report of the requests it ran itself (oip/front_runs.py), since its last: per "name@version",
    what the engine counts of its own (executor/stats.py): latency bucket counts and their sum (s), rows, run
    seconds, failures and their seconds, the last one's wall-clock time (ms)."""
    req_id: int
    models: dict = {}


class FrontServedReply(Message, kind="front_served_ok"):
    req_id: int
    # Times memory pressure has dropped the daemon's cached answers since it started: a front that sees the
    # count grow drops its own response cache too (oip/front_runs.py).
    answers_dropped: int = 0
    # "name@version" of versions waiting to be swapped for a replacement (daemon/swaps.py): a front lets go of
    # its sessions over them, so that the swap is not kept waiting by this front's traffic.
    replacing: list = []


class LogSettings(Message, kind="log_settings"):
    """Triton's logging extension (a front's GET or POST /v2/logging, gRPC LogSettings): `update` the settings it
    names (Triton's names and types; none: only read them), answered with all of them (daemon/log_settings.py)."""
    req_id: int
    update: dict = {}


class LogSettingsReply(Message, kind="log_settings_ok"):
    req_id: int
    settings: dict = {}


class Stats(Message, kind="stats"):
    req_id: int


class StatsReply(Message, kind="stats_ok"):
    req_id: int
    daemon_version: str
    pid: int
    uptime_s: float
    socket: str
    clients: list = []
    models: list = []
    tiers: list = []
    counters: dict = {}
    jobs: list = []      # in-flight packs and loads, with progress
    executor: dict = {}  # workers, scheduler, served requests, performance-model error


class ErrorReply(Message, kind="error"):
    req_id: int
    code: str
    message: str


# -- encoding ----------------------------------------------------------------------------

# Requests come from any client that can reach the socket, so decoding one must cost no more than
# a small multiple of its size. msgpack's own limits (each string and container at most the body's
# length) do not bound how many objects a body makes: a 50 MB array of zeros became 50 million list
# slots (+853 MiB in the daemon). Big tensors travel in shm files, so a request is a few maps and short
# lists; REQUEST_MAX_ITEMS bounds each container and, together, every element of every container.
REQUEST_MAX_ITEMS = 1 << 16


class _TooManyItems(ValueError):
    pass


def _unpack(body: bytes, max_items: int | None) -> Any:
    if max_items is None or len(body) <= max_items:  # (an item takes at least one byte of the body)
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    budget = [max_items]

    def count(container):  # called as each list or map is completed, inner ones first
        budget[0] -= len(container) + 1
        if budget[0] < 0:
            raise _TooManyItems(f"more than {max_items} items")
        return container

    return msgpack.unpackb(body, raw=False, strict_map_key=True, max_array_len=max_items,
                           max_map_len=max_items, list_hook=count, object_hook=count)


def encode(msg: Message) -> list[bytes]:
    return [msg.KIND, msgpack.packb(msg.to_dict(), use_bin_type=True)]


def decode(frames: list[bytes], expect: tuple[type, ...] | None = None, max_items: int | None = None) -> Any:
    """Two frames -> the message object; ProtocolError says exactly what is wrong.

    max_items: bound the containers' elements (the daemon passes REQUEST_MAX_ITEMS: see above);
    None for replies, which come from one's own daemon and may list thousands of tensors."""
    if len(frames) != 2:
        raise ProtocolError(f"a message is 2 frames (kind, body), got {len(frames)}")
    kind, body = frames
    cls = MESSAGES.get(bytes(kind))
    if cls is None:
        raise ProtocolError(f"unknown message kind {bytes(kind)[:40]!r}")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message {cls.KIND.decode()!r}; expected one of "
                            f"{', '.join(c.KIND.decode() for c in expect)}")
    try:
        data = _unpack(body, max_items)
    except _TooManyItems as e:
        raise ProtocolError(f"{cls.KIND.decode()}: body refused: {e}") from None
    except ValueError as e:   # msgpack's own limits say what was too big; other ValueErrors, what is broken
        raise ProtocolError(f"{cls.KIND.decode()}: body is not valid msgpack ({str(e)[:200]})") from None
    except Exception as e:
        raise ProtocolError(f"{cls.KIND.decode()}: body is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"{cls.KIND.decode()}: body must be a map, got {type(data).__name__}")
    msg = cls.__new__(cls)  # filled here rather than through __init__: this runs for every message
    attrs = msg.__dict__
    try:
        for name, type_text, accept, optional, default in cls.CHECKS:
            if name in data:
                value = data[name]
                if not (isinstance(value, accept) and (type(value) is not bool or bool in accept)
                        or (optional and value is None)):
                    raise ProtocolError(f"{cls.KIND.decode()}.{name}: expected {type_text}, got {type(value).__name__}")
                attrs[name] = value
            elif default is _REQUIRED:
                raise ProtocolError(f"{cls.KIND.decode()}: missing field {name!r}")
            else:
                attrs[name] = _fresh(default)
        check = getattr(cls, "_check_decoded", None)
        if check is not None:   # nested records: decoded into their types and checked here, once
            check(msg)
    except ProtocolError as e:
        # A refused request's descriptors must still be taken off its connection, or the next message gets them.
        declared = data.get("ipc_fds", 0)
        e.declared_fds = declared if type(declared) is int else None
        raise
    return msg  # fields it does not know are ignored: newer peers may add some


def req_id_of(frames: list[bytes]) -> int:
    """Best-effort request id of a message that failed to decode, so the error still finds its caller.

    Reads the body's map key by key and skips the other values unbuilt: this runs on whatever
    failed to decode, a body made to inflate included."""
    try:
        unpacker = msgpack.Unpacker(raw=False, max_str_len=64, max_bin_len=64, max_array_len=0, max_map_len=64)
        unpacker.feed(memoryview(frames[-1])[:1 << 16])   # feed() copies: the id is near the start, or is lost
        for _ in range(unpacker.read_map_header()):
            if unpacker.unpack() == "req_id":
                rid = unpacker.unpack()
                return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
            unpacker.skip()
    except Exception:
        pass
    return 0
