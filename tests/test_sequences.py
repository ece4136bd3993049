"""The sequence batcher's table (executor/sequences.py), with an injected clock: one request of a sequence at a
time, in order; state carried from one request to the next; slots and the backlog; the idle timeout; Triton's
refusals. No daemon here: `go` records what would run, and the test says when it is done."""

from __future__ import annotations

import numpy as np
import pytest

from fake_clock import FakeClock
from modelcache.errors import InputError, RequestTimeout
from modelcache.executor.sequences import Control, SequenceSpec, SequenceTable, State

SPEC = SequenceSpec(controls=(Control("START", "start", "int32", 0, 1, 2), Control("END", "end", "int32", 0, 1, 2),
                              Control("READY", "ready", "float32", 0.0, 1.0, 2),
                              Control("CORRID", "corrid", "uint64", 0, 0, 2)),
                    states=(State("S_IN", "S_OUT", "float32", (1, 3)),),
                    strategy="oldest", idle_us=1_000_000, slots=2)


class Runs:
    """What the table handed on: (seq id, feeds, done) per request, in order."""

    def __init__(self):
        self.started, self.failed = [], []

    def request(self, table, seq_id, start=False, end=False, deadline=None):
        table.submit(seq_id, start, end, deadline, lambda feeds, done: self.started.append((seq_id, feeds, done)),
                     lambda error: self.failed.append((seq_id, error)))


def make():
    clock = FakeClock()
    return clock, SequenceTable("acc@1", SPEC, clock), Runs()


def test_controls_and_state_flow_from_one_request_to_the_next():
    _, table, runs = make()
    runs.request(table, 7, start=True)
    seq, feeds, done = runs.started[0]
    assert feeds["START"].tolist() == [[1]] and feeds["END"].tolist() == [[0]] and feeds["READY"].tolist() == [[1.0]]
    assert feeds["CORRID"].dtype == np.uint64 and feeds["CORRID"].tolist() == [[7]]
    assert feeds["S_IN"].tolist() == [[0, 0, 0]]   # no initial_state: zeros
    done({"S_OUT": np.full((1, 3), 5.0, np.float32)})
    runs.request(table, 7, end=True)
    _, feeds, done = runs.started[1]
    assert feeds["START"].tolist() == [[0]] and feeds["END"].tolist() == [[1]]
    assert feeds["S_IN"].tolist() == [[5, 5, 5]]
    done({"S_OUT": np.zeros((1, 3), np.float32)})
    assert table.sequences == {} and table.active == 0   # ended: its slot and state are gone


def test_a_sequences_requests_run_one_at_a_time_in_arrival_order():
    _, table, runs = make()
    runs.request(table, 1, start=True)
    runs.request(table, 1)
    runs.request(table, 1, end=True)
    assert len(runs.started) == 1                          # the others wait for the first one's state
    runs.started[0][2]({"S_OUT": np.ones((1, 3), np.float32)})
    assert len(runs.started) == 2 and runs.started[1][1]["S_IN"].tolist() == [[1, 1, 1]]
    runs.started[1][2](None)                               # a failed request: the state stays as it was
    assert runs.started[2][1]["S_IN"].tolist() == [[1, 1, 1]] and runs.started[2][1]["END"].tolist() == [[1]]


def test_sequences_beyond_the_slots_wait_in_arrival_order_for_one_to_end():
    _, table, runs = make()
    for seq in (1, 2, 3, 4):
        runs.request(table, seq, start=True)
    assert [s for s, _, _ in runs.started] == [1, 2] and table.describe()["backlog"] == 2
    runs.request(table, 3, end=True)                       # queued behind its own start, in the backlog
    runs.started[0][2]({})                                 # sequence 1's request done: it keeps its slot
    assert len(runs.started) == 2
    runs.request(table, 1, end=True)
    runs.started[2][2]({})                                 # sequence 1 ends: the oldest waiting one goes
    assert [s for s, _, _ in runs.started] == [1, 2, 1, 3]


def test_a_sequence_idle_past_max_sequence_idle_is_dropped_and_needs_start_again():
    clock, table, runs = make()
    runs.request(table, 5, start=True)
    runs.started[0][2]({"S_OUT": np.ones((1, 3), np.float32)})
    assert table.next_timer() == pytest.approx(clock.now + 1.0)
    clock.now += 0.5
    table.on_timer(clock.now)
    assert 5 in table.sequences                           # not yet
    clock.now += 0.6
    table.on_timer(clock.now)
    assert table.sequences == {} and table.active == 0
    with pytest.raises(InputError, match="sequence 5 to model 'acc' must specify the START flag"):
        runs.request(table, 5)


def test_busy_sequences_do_not_idle_out():
    clock, table, runs = make()
    runs.request(table, 5, start=True)
    clock.now += 10
    table.on_timer(clock.now)
    assert 5 in table.sequences and table.next_timer() is None


def test_triton_refusals():
    _, table, runs = make()
    with pytest.raises(InputError, match="must specify a non-zero or non-empty correlation ID"):
        runs.request(table, 0, start=True)
    with pytest.raises(InputError, match="must specify the START flag"):
        runs.request(table, 9)
    with pytest.raises(InputError, match="CORRID control 'CORRID' is uint64: send a number"):
        runs.request(table, "abc", start=True)
    runs.request(table, 9, start=True, end=True)           # a one-request sequence
    runs.started[0][2]({})
    with pytest.raises(InputError, match="START"):         # ended: the id is free again
        runs.request(table, 9)


def test_a_request_whose_deadline_passed_while_queued_is_answered_not_run():
    clock, table, runs = make()
    runs.request(table, 1, start=True)
    runs.request(table, 1, deadline=clock.now + 0.1)
    runs.request(table, 1, end=True)
    clock.now += 1
    runs.started[0][2]({})
    assert isinstance(runs.failed[0][1], RequestTimeout)
    assert len(runs.started) == 2 and runs.started[1][1]["END"].tolist() == [[1]]


def test_a_new_start_before_the_end_restarts_the_state():
    _, table, runs = make()
    runs.request(table, 1, start=True)
    runs.started[0][2]({"S_OUT": np.ones((1, 3), np.float32)})
    runs.request(table, 1, start=True)
    assert runs.started[1][1]["S_IN"].tolist() == [[0, 0, 0]]


def test_string_ids_and_initial_state_from_data():
    spec = SequenceSpec(controls=(Control("ID", "corrid", "object", 0, 0, 1),),
                        states=(State("h", "h_out", "int64", (2,), np.array([3, 4], np.int64).tobytes()),), slots=1)
    assert SequenceSpec.from_wire(spec.to_wire()) == spec
    table, runs = SequenceTable("m@1", spec, FakeClock()), Runs()
    runs.request(table, "user-42", start=True)
    feeds = runs.started[0][1]
    assert feeds["ID"].tolist() == ["user-42"] and feeds["h"].tolist() == [3, 4]


def test_stored_specs_are_checked():
    with pytest.raises(ValueError, match="kind"):
        SequenceSpec.from_wire({"controls": [{"name": "x", "kind": "nope", "dtype": "int32"}]})
    with pytest.raises(ValueError, match="slots"):
        SequenceSpec.from_wire({"slots": 0})
    with pytest.raises(ValueError, match="malformed"):
        SequenceSpec.from_wire({"states": [{"input": "a"}]})


def test_close_answers_every_queued_request():
    _, table, runs = make()
    runs.request(table, 1, start=True)
    runs.request(table, 1)
    for seq in (2, 3):
        runs.request(table, seq, start=True)
    table.close(InputError("gone"))
    assert sorted(s for s, _ in runs.failed) == [1, 3] and table.sequences == {}


# -- at import: the configuration checked against the model (triton_repo/sequence.py) ---------------------------

def plan(tmp_path, config: str):
    from test_triton_examples import sequence_model

    from modelcache.store.packing import model_io
    from modelcache.triton_repo.config import plan_model
    model, _ = sequence_model("simple_string_dyna_sequence")
    import onnx
    (tmp_path / "m" / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(tmp_path / "m" / "1" / "model.onnx"))
    (tmp_path / "m" / "config.pbtxt").write_text(config)
    return plan_model(tmp_path / "m", model_io)


def config_of(controls: str, state: str = 'state [ { input_name: "STATE_IN" output_name: "STATE_OUT" '
                                          'data_type: TYPE_INT32 dims: [ 1 ] } ]') -> str:
    return f"""max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{ control_input [ {controls} ] {state} }}"""


FLAGS = ('{ name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }, '
         '{ name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }, '
         '{ name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] }')
CORRID = '{ name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }'


def test_a_stateful_config_imports_with_its_spec(tmp_path):
    p = plan(tmp_path, config_of(f"{FLAGS}, {CORRID}"))
    spec = SequenceSpec.from_wire(p.serving["sequence"])
    assert {c.kind for c in spec.controls} == {"start", "ready", "end", "corrid"}
    assert spec.states[0].shape == (1, 1) and spec.slots == 8 * 2    # 8 slots per instance, 2 CPU instances
    assert p.serving["policy"] == "dynamic" and "sequence_batching" not in p.not_honoured
    assert p.config["sequence_batching"]["max_sequence_idle_microseconds"] == 1_000_000


@pytest.mark.parametrize("controls, state, words", [
    (FLAGS, None, "the model's input 'CORRID' is not configured"),
    (FLAGS.replace("int32_false_true", "fp32_false_true", 1) + f", {CORRID}", None,
     "control 'START' is float32; m/1/model.onnx has int32 for it"),
    (f"{FLAGS}, {CORRID.replace('TYPE_STRING', 'TYPE_UINT64')}", None, "control 'CORRID' is uint64"),
    (f"{FLAGS}, {CORRID}", 'state [ { input_name: "STATE_IN" output_name: "NOPE" data_type: TYPE_INT32 '
     'dims: [ 1 ] } ]', "no input 'STATE_IN' in the model|state output 'NOPE'"),
    (f"{FLAGS}, {CORRID}", 'state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 '
     'dims: [ 2 ] } ]', "the dims differ"),
    (f"{FLAGS}, {CORRID}", 'state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 '
     'dims: [ 1 ] initial_state { data_type: TYPE_INT32 dims: [ 1 ] data_file: "missing" name: "s" } } ]',
     "cannot be read"),
])
def test_a_stateful_config_the_model_contradicts_is_refused(tmp_path, controls, state, words):
    with pytest.raises(InputError, match=words):
        plan(tmp_path, config_of(controls, state) if state else config_of(controls))


@pytest.mark.parametrize("sequence, words", [({"id": [1], "start": True}, "give an unsigned integer or a string"),
                                             ({"id": 5, "start": "yes"}, "sequence_start 'yes'"),
                                             ({"id": -1}, r"within 0\.\.2\^64-1")])
def test_an_infer_with_a_malformed_sequence_is_refused_as_it_is_decoded(sequence, words):
    """(before anything holds the model: an unhashable id once reached the table with the model held)"""
    from modelcache.errors import RecordError
    from modelcache.wire import protocol as P
    with pytest.raises(RecordError, match=words):
        P.decode(P.encode(P.Infer(req_id=1, client_id="", name="m", inputs=[], sequence=sequence)))
