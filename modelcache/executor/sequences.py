"""Triton's sequence batcher for ONNX models: a model's sequences, their control inputs and implicit state.

A stateful model (Triton's `sequence_batching`) gets requests that each name a sequence (a correlation id, a
uint64 or a string) and say whether it starts or ends it. Here, as in Triton's core:
- the server fills the model's **control inputs** for each request: START and END (the request's flags),
  READY (always true: a batch here has no padding rows), CORRID (the sequence's id, in the configured type);
- **implicit state**: each `state` entry's output of a sequence's request is fed as its input to the
  sequence's next request; a request that starts a sequence gets the initial state (the configured
  `initial_state`, else zeros);
- a sequence's requests run one at a time, in arrival order (the state of one is the input of the next);
  requests of different sequences run together, batched by the model's own policy (`direct` and `oldest`
  both form batches from one request per sequence);
- at most `slots` sequences are active at once (Triton's batch slots: max(1, max_batch_size) per instance,
  or `oldest.max_candidate_sequences`); a sequence started beyond them waits in a backlog, in arrival
  order, for one to end or to be idle for `max_sequence_idle_microseconds` (then it is dropped, its state
  with it, and a later request without START is refused in Triton's words).

`SequenceSpec` is what `modelcache import-triton` stores in the model's manifest (`serving["sequence"]`);
`SequenceTable` is one model's sequences, on the daemon's owner loop, with an injected clock. It runs
nothing itself: `go(extra_feeds, done)` hands a request on to the engine, and `done(state_outputs)` (None when
the request failed: the state stays) lets the sequence's next request go.
"""

from __future__ import annotations

import base64
import logging
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..errors import InputError, RequestTimeout

log = logging.getLogger("modelcache.daemon")

CONTROL_KINDS = ("start", "end", "ready", "corrid")
CONTROL_DTYPES = ("int32", "float32", "bool", "int64", "uint64", "uint32", "object")   # object: strings
STRATEGIES = ("direct", "oldest")
DEFAULT_IDLE_US = 1_000_000   # Triton's SEQUENCE_IDLE_DEFAULT_MICROSECONDS


@dataclass(frozen=True)
class Control:
    name: str
    kind: str             # start, end, ready or corrid
    dtype: str            # numpy's name, as manifests say it ("object": a string CORRID)
    false: object = 0     # the values a boolean control takes (Triton's int32/fp32/bool_false_true)
    true: object = 1
    rank: int = 1         # the model input's rank: the control is an array of that many dims of 1

    def value(self, start: bool, end: bool, corrid) -> np.ndarray:
        if self.kind == "corrid":
            v = corrid
        else:
            v = self.true if {"start": start, "end": end, "ready": True}[self.kind] else self.false
        return np.full((1,) * self.rank, v, dtype=self.dtype)


@dataclass(frozen=True)
class State:
    input: str
    output: str
    dtype: str
    shape: tuple              # the initial state's shape, batch dimension (1) included where the model batches
    initial: bytes | None = None   # its raw data (Triton's initial_state data_file); None: zeros
    returned: bool = False    # also one of the model's configured outputs: a client may ask for it

    def initial_value(self) -> np.ndarray:
        dtype = np.dtype(self.dtype)
        if self.initial is None:
            return np.full(self.shape, "", dtype=object) if dtype.kind == "O" else np.zeros(self.shape, dtype)
        return np.frombuffer(self.initial, dtype=dtype).reshape(self.shape).copy()


@dataclass(frozen=True)
class SequenceSpec:
    controls: tuple = ()
    states: tuple = ()
    strategy: str = "direct"
    idle_us: int = DEFAULT_IDLE_US
    slots: int = 1

    @cached_property
    def example_feeds(self) -> dict:
        """What the server adds to a request's feeds, with placeholder values: checks a request's own feeds against
        the model before the sequence's turn (the real ones differ in value only)."""
        return self.feeds(True, True, "" if any(c.kind == "corrid" and c.dtype == "object" for c in self.controls)
                          else 0, None)

    @property
    def state_outputs(self) -> set:
        return {s.output for s in self.states}

    @property
    def hidden_inputs(self) -> set:
        """The model inputs the server fills, which clients neither send nor see."""
        return {c.name for c in self.controls} | {s.input for s in self.states}

    def corrid(self, seq_id):
        """The request's sequence id as its CORRID control takes it; InputError where it cannot."""
        for c in self.controls:
            if c.kind == "corrid" and c.dtype != "object":
                if not isinstance(seq_id, int):
                    raise InputError(f"sequence id {seq_id!r} is a string; the model's CORRID control {c.name!r} "
                                     f"is {c.dtype}: send a number")
                info = np.iinfo(c.dtype)
                if not info.min <= seq_id <= info.max:
                    raise InputError(f"sequence id {seq_id} does not fit the model's CORRID control {c.name!r} "
                                     f"({c.dtype})")
            elif c.kind == "corrid":
                return str(seq_id)
        return seq_id

    def feeds(self, start: bool, end: bool, corrid, state: dict | None) -> dict:
        out = {c.name: c.value(start, end, corrid) for c in self.controls}
        for s in self.states:
            out[s.input] = s.initial_value() if start or state is None or s.output not in state else state[s.output]
        return out

    def to_wire(self) -> dict:
        """As stored in a manifest (JSON): initial states in base64."""
        return {"controls": [c.__dict__ for c in self.controls],
                "states": [{**s.__dict__, "shape": list(s.shape),
                            "initial": None if s.initial is None else base64.b64encode(s.initial).decode()}
                           for s in self.states],
                "strategy": self.strategy, "idle_us": self.idle_us, "slots": self.slots}

    @classmethod
    def from_wire(cls, d) -> "SequenceSpec":
        """ValueError says what is wrong with a stored spec."""
        if not isinstance(d, dict):
            raise ValueError("a model's sequence batching is a map of its fields")
        try:
            controls = tuple(Control(**c) for c in d.get("controls", []))
            states = tuple(State(**{**s, "shape": tuple(s["shape"]),
                                    "initial": None if s.get("initial") is None else base64.b64decode(s["initial"])})
                           for s in d.get("states", []))
            spec = cls(controls, states, d.get("strategy", "direct"), d.get("idle_us", DEFAULT_IDLE_US),
                       d.get("slots", 1))
        except (TypeError, KeyError, ValueError) as e:
            raise ValueError(f"a model's sequence batching is malformed: {e}") from None
        for c in controls:
            if c.kind not in CONTROL_KINDS or c.dtype not in CONTROL_DTYPES:
                raise ValueError(f"sequence control {c.name!r}: kind {c.kind!r} / dtype {c.dtype!r} unknown")
        if spec.strategy not in STRATEGIES or type(spec.slots) is not int or spec.slots < 1 \
                or type(spec.idle_us) is not int or spec.idle_us < 1:
            raise ValueError("sequence batching needs strategy direct or oldest, slots >= 1 and idle_us >= 1")
        return spec


@dataclass
class _Request:
    start: bool
    end: bool
    corrid: object
    deadline: float | None
    go: object            # (extra feeds, done) -> None: hands the request on
    fail: object          # (error) -> None: answers it with an error, never run


@dataclass
class _Sequence:
    id: object
    queue: deque = field(default_factory=deque)
    state: dict | None = None
    busy: bool = False
    active: bool = False   # holds a slot
    open: bool = True      # no END sent yet: more requests may come without START
    last: float = 0.0


class SequenceTable:
    """One model's sequences (see the module's docstring). `key` names the model in errors and logs."""

    def __init__(self, key: str, spec: SequenceSpec, clock):
        self.key, self.spec, self.clock = key, spec, clock
        self.sequences: dict = {}      # id -> _Sequence
        self.backlog: deque = deque()  # sequences waiting for a slot, by arrival
        self.active = 0

    def submit(self, seq_id, start: bool, end: bool, deadline: float | None, go, fail) -> None:
        """Queue one request of sequence `seq_id`; it goes (`go`) when the sequence's earlier requests are done
        and the sequence has a slot. InputError, raised here, for a request Triton would refuse."""
        if seq_id is None or seq_id == 0 or seq_id == "":
            raise InputError(f"inference request to model '{self.key.rpartition('@')[0]}' must specify a non-zero "
                             "or non-empty correlation ID")
        corrid = self.spec.corrid(seq_id)
        seq = self.sequences.get(seq_id)
        if not start and (seq is None or not seq.open):
            raise InputError(f"inference request for sequence {seq_id} to model '{self.key.rpartition('@')[0]}' "
                             "must specify the START flag on the first request of the sequence")
        if seq is None:
            seq = self.sequences[seq_id] = _Sequence(seq_id)
            self._enter(seq)
        elif start and seq.open and (seq.queue or seq.busy or seq.state is not None):
            log.warning("sequence %s for model %s: started again before it ended; the earlier one ends here",
                        seq_id, self.key)
        seq.open = not end
        seq.last = self.clock()
        seq.queue.append(_Request(start, end, corrid, deadline, go, fail))
        self._pump(seq)

    def _enter(self, seq: _Sequence) -> None:
        if self.active < self.spec.slots:
            seq.active = True
            self.active += 1
        else:
            self.backlog.append(seq)

    def _pump(self, seq: _Sequence) -> None:
        while seq.active and not seq.busy and seq.queue:
            req = seq.queue.popleft()
            if req.deadline is not None and self.clock() > req.deadline:
                req.fail(RequestTimeout(f"{self.key}: deadline passed while the request waited for its sequence "
                                        f"{seq.id}'s earlier requests"))
                self._after(seq, req, None)
                continue
            seq.busy = True
            feeds = self.spec.feeds(req.start, req.end, req.corrid, seq.state)
            answered = []

            def done(states, seq=seq, req=req):
                if not answered:      # once, whatever the caller does
                    answered.append(True)
                    seq.busy = False
                    self._after(seq, req, states)
                    self._pump(seq)

            try:
                req.go(feeds, done)
            except Exception as e:   # (go answers its own errors; this is a bug's safety net: never stuck)
                log.exception("%s: a sequence request failed to start", self.key)
                req.fail(e)
                done(None)
            return
        if seq.active and not seq.busy and not seq.queue and not seq.open:
            self._drop(seq)

    def _after(self, seq: _Sequence, req: _Request, states: dict | None) -> None:
        seq.last = self.clock()
        if req.start:
            seq.state = None
        if states is not None:
            seq.state = states
        if req.end:
            seq.state = None

    def _drop(self, seq: _Sequence) -> None:
        """The sequence ends (or idled out): its slot goes to the oldest backlogged sequence."""
        if self.sequences.get(seq.id) is seq:
            del self.sequences[seq.id]
        if seq.active:
            seq.active = False
            self.active -= 1
        while self.backlog and self.active < self.spec.slots:
            nxt = self.backlog.popleft()
            nxt.active = True
            self.active += 1
            self._pump(nxt)

    def next_timer(self) -> float | None:
        idle = [s.last for s in self.sequences.values() if s.active and not s.busy and not s.queue]
        return min(idle) + self.spec.idle_us / 1e6 if idle else None

    def on_timer(self, now: float) -> None:
        """Drop the sequences idle for longer than max_sequence_idle_microseconds."""
        limit = self.spec.idle_us / 1e6
        for seq in [s for s in self.sequences.values() if s.active and not s.busy and not s.queue
                    and now - s.last >= limit]:
            log.info("sequence %s of %s dropped after %.3f s idle (max_sequence_idle_microseconds %d)",
                     seq.id, self.key, now - seq.last, self.spec.idle_us)
            self._drop(seq)

    def close(self, error: Exception) -> None:
        """The model goes: every queued request is answered with `error`; nothing runs any more."""
        for seq in list(self.sequences.values()):
            while seq.queue:
                seq.queue.popleft().fail(error)
        self.sequences.clear()
        self.backlog.clear()
        self.active = 0

    def describe(self) -> dict:
        return {"active": self.active, "backlog": len(self.backlog),
                "queued": sum(len(s.queue) for s in self.sequences.values())}
