"""Batching in the real daemon: requests queued at once are stacked, run, and split back exactly."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest

from modelcache import calibration, zoo
from modelcache.client.calibrate import calibrate
from modelcache.client.stream import InferStream
from modelcache.errors import CapacityError, InputError
from modelcache.wire import tensors
from conftest import DaemonProcess


@contextlib.contextmanager
def batching_daemon(tmp_path, policy: str, **env):
    """A daemon with one 2-thread worker group and this batching policy, and a client of it."""
    extra = {"MODELCACHE_WORKERS": "2", "MODELCACHE_BATCHING": policy,
             "MODELCACHE_STATE_DIR": str(tmp_path / "state"), **{f"MODELCACHE_{k.upper()}": str(v) for k, v in env.items()}}
    d = DaemonProcess(tmp_path, extra).start()
    try:
        with d.client() as c:
            yield d, c
    finally:
        assert d.stop() == 0, d.log_path.read_text()[-3000:]
        d.kill()


def send_all(c, name: str, feeds_list: list[dict], gap_s: float = 0.0, first_alone: bool = False,
             refused: dict | None = None) -> dict:
    """Queue every request on one stream (gap_s apart), then collect: req_id -> (outputs, timings).
    first_alone: the rest are sent once the daemon has started the first (requests that reach the engine
    together are batched together from the start). refused: where errors go (req_id -> error); else none may come."""
    answers, errors_ok = {}, refused is not None
    refused = {} if refused is None else refused
    with InferStream(c) as stream:
        for i, feeds in enumerate(feeds_list):
            wire, files = tensors.encode(feeds, inline_only=True)
            stream.send(i, name, wire)
            if gap_s:
                time.sleep(gap_s)
            deadline = time.monotonic() + 30
            while first_alone and i == 0 and not c.stats().executor["in_flight"] and time.monotonic() < deadline:
                time.sleep(0.001)
        deadline = time.monotonic() + 60
        while len(answers) + len(refused) < len(feeds_list) and time.monotonic() < deadline:
            for req_id, wire, timings, error in stream.receive(1000):
                if error is not None:
                    refused[req_id] = error
                else:
                    answers[req_id] = (tensors.decode(wire)[0], timings)
    assert errors_ok or not refused, next(iter(refused.values()))
    assert len(answers) + len(refused) == len(feeds_list)
    return answers


def test_dynamic_batching_stacks_queued_requests_and_splits_outputs_back(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    # (a 50 ms wait for a fuller batch: on a busy machine the 12 requests may arrive further apart than a
    # tiny model's run, and without it each would run as it came)
    with batching_daemon(tmp_path, "dynamic", max_batch=6, max_queue_delay_ms=50) as (d, c):
        c.add(src, "cnn")
        c.infer("cnn", zoo.sample_inputs(src))          # resident, session built
        sizes = [1, 2, 1, 3, 1, 1, 2, 1, 1, 4, 1, 1]    # multi-sample requests are kept whole
        feeds_list = [zoo.sample_inputs(src, batch=n, seed=i) for i, n in enumerate(sizes)]
        answers = send_all(c, "cnn", feeds_list)
        for i, feeds in enumerate(feeds_list):
            out, timings = answers[i]
            np.testing.assert_allclose(out["logits"], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-5)
            assert out["logits"].shape[0] == sizes[i]
            assert sizes[i] <= timings["stages"][0]["batch"] <= max(6, sizes[i])
        batching = c.stats().executor["batching"]
        assert batching["policies"] == {"*": "dynamic"}
        assert batching["mean_batch"] > 1.5, batching   # 12 requests queued behind one: stacked


def test_layer_to_layer_merges_late_requests_into_the_running_batch(tmp_path, zoo_file):
    src = zoo_file("resnet50")
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    with batching_daemon(tmp_path, "layer", t_opt_ms=60000) as (d, c):
        c.add(src, "r50")
        c.partition("r50", stages=3)
        # ResNet-50 gains nothing from batching on this CPU, so a real calibration would (rightly)
        # refuse every join. This profile says batches of 4 cost 1.5x a batch of 1 per stage: it
        # drives the decision, and the test checks what the daemon does with the tensors.
        c.set_batching("r50", {"kind": "cpu2", "batches": [1, 4], "stage_s": [[0.02] * 3, [0.03] * 3],
                               "ratios": [[1 / 3] * 3] * 2, "g": [0.06, 0.0225, 2.0, 2.0],
                               "t_opt_ms": 60000.0, "n_opt": 8})
        # One request starts a batch alone (the worker is idle); three more queue while its first
        # stage runs, and join it at the next boundary after catching up.
        feeds_list = [zoo.sample_inputs(src, seed=i) for i in range(4)]
        answers = send_all(c, "r50", feeds_list, first_alone=True)
        for i, feeds in enumerate(feeds_list):
            np.testing.assert_allclose(answers[i][0]["logits"], ref.run(None, feeds)[0], rtol=1e-3, atol=1e-4)
        batches = [[st["batch"] for st in answers[i][1]["stages"]] for i in range(4)]
        # Stage 0 alone; the three late ones catch up (together, or a straggler on its own where the machine
        # delays its send past a stage: [1, 3, 4] under a loaded test run) and join at a boundary, so the
        # last stage runs all four as one batch.
        assert batches[0][0] == 1 and batches[0] == sorted(batches[0]), batches
        assert all(b[-1] == 4 for b in batches), batches
        assert 1 <= c.stats().executor["batching"]["layer_joins"] <= 3


def test_a_burst_past_the_queue_bound_is_refused_at_once_and_the_rest_served(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    with batching_daemon(tmp_path, "serial", max_queue=2, inline_run_ms=0) as (d, c):
        c.add(src, "cnn")
        # The model is on disk: the burst waits for its promotion, then reaches the queue at once.
        feeds_list = [zoo.sample_inputs(src, seed=i) for i in range(24)]
        refused = {}
        served = {i: outputs for i, (outputs, _) in send_all(c, "cnn", feeds_list, refused=refused).items()}
        assert len(served) + len(refused) == len(feeds_list) and served and refused, (len(served), len(refused))
        assert all(isinstance(e, CapacityError) and "Exceeds maximum queue size (2)" in str(e)
                   for e in refused.values()), next(iter(refused.values()))
        for i, outputs in served.items():
            np.testing.assert_allclose(outputs["logits"], ref.run(None, feeds_list[i])[0], rtol=1e-3, atol=1e-4)
        stats = c.stats().executor
        assert stats["refused"] == {"queue_full": len(refused), "queue_timeout": 0}
        status = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=d.env, capture_output=True,
                                text=True, timeout=60)
        assert f"failed ({len(refused)} refused by a full queue)," in status.stdout, status.stdout
        out, _ = c.infer("cnn", feeds_list[0])       # the queue drained: served again
        np.testing.assert_allclose(out["logits"], ref.run(None, feeds_list[0])[0], rtol=1e-3, atol=1e-4)


def test_calibration_is_stored_with_the_model_and_cleared_by_a_new_partition(tmp_path, zoo_file):
    src = zoo_file("tiny-cnn")
    with batching_daemon(tmp_path, "layer") as (d, c):
        c.add(src, "cnn")
        c.partition("cnn", stages=2)
        profile = calibrate(c, "cnn", batches=[1, 2, 8], runs=3, t_opt_ms=500)
        manifest = json.loads((d.repository / "cnn" / "1" / "manifest.json").read_text())
        stored = manifest["batching"]
        assert stored["batches"] == [1, 2, 8] and stored["t_opt_ms"] == 500
        # N_opt is what the measured times allow (1 where a loaded machine shows batching no gain), from g as stored.
        assert stored["n_opt"] == calibration.n_opt(tuple(stored["g"]), 0.25, max_batch=32)
        assert stored == json.loads(json.dumps(profile))
        with pytest.raises(InputError, match="calibrate again after partitioning"):
            c.set_batching("cnn", {**profile, "stage_s": [[0.1]] * 3, "ratios": [[1.0]] * 3})   # one stage
        c.partition("cnn", stages=1)
        manifest = json.loads((d.repository / "cnn" / "1" / "manifest.json").read_text())
        assert manifest["batching"] == {}
        out, timings = c.infer("cnn", zoo.sample_inputs(src))   # serving goes on without a profile
        assert out["logits"].shape == (1, 10)
