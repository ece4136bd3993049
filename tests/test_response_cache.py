"""The response cache (executor/response_cache.py): its key and its bounds in process, the Triton importer's
mapping of `response_cache { enable: true }`, and a real daemon answering repeated inputs from it through both
fronts and a serve-mode client, counted as Triton counts them, emptied by a reload to size 0 and by a removal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from modelcache.calibration import check_serving
from modelcache.errors import InputError
from modelcache.executor.response_cache import ENTRY_OVERHEAD, ResponseCache, request_key
from modelcache.store.packing import model_io
from modelcache.triton_repo.config import plan_model

from conftest import stop_cleanly, wait_until
from test_triton_repo import put_model, save, start_importing

KiB = 1 << 10


# -- the key -----------------------------------------------------------------------------------------

def test_the_key_changes_with_anything_an_answer_depends_on():
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    key = request_key("m@1\0sha", {"x": x, "n": np.array([2], np.int64)}, None)
    assert key == request_key("m@1\0sha", {"n": np.array([2], np.int64), "x": x.copy()}, None)  # any feed order
    assert key == request_key("m@1\0sha", {"x": np.asfortranarray(x), "n": np.array([2], np.int64)}, None)
    others = [request_key("m@2\0sha", {"x": x, "n": np.array([2], np.int64)}, None),        # another version
              request_key("m@1\0sh2", {"x": x, "n": np.array([2], np.int64)}, None),        # another file
              request_key("m@1\0sha", {"x": x, "n": np.array([3], np.int64)}, None),        # one byte
              request_key("m@1\0sha", {"x": x.reshape(4, 3), "n": np.array([2], np.int64)}, None),   # shape
              request_key("m@1\0sha", {"x": x.view(np.int32), "n": np.array([2], np.int64)}, None),  # type
              request_key("m@1\0sha", {"y": x, "n": np.array([2], np.int64)}, None),        # name
              request_key("m@1\0sha", {"x": x, "n": np.array([2], np.int64)}, ["y"])]       # outputs asked
    assert len({key, *others}) == 1 + len(others)
    assert request_key("m", {}, ["a", "b"]) == request_key("m", {}, ["b", "a"]) != request_key("m", {}, None)
    # strings: each element with its length, so a split in another place is another request
    assert request_key("m", {"s": np.array(["ab", "c"], object)}, None) != \
        request_key("m", {"s": np.array(["a", "bc"], object)}, None)


# -- the bounds -------------------------------------------------------------------------------------

def answer(kib: int, fill: float = 0.0) -> dict:
    return {"y": np.full(kib * KiB // 4, fill, np.float32)}


def test_least_recently_used_answers_go_first_within_the_bytes():
    cache = ResponseCache(3 * (4 * KiB + ENTRY_OVERHEAD))
    for k in b"abc":
        assert cache.put(bytes([k]), "m", answer(4, k))
    assert cache.get(b"a")["y"][0] == ord("a")         # a used again: b is now the oldest
    assert cache.put(b"d", "m", answer(4))
    assert [bytes([k]) in cache.entries for k in b"abcd"] == [True, False, True, True]
    assert cache.bytes == 3 * (4 * KiB + ENTRY_OVERHEAD) and cache.evicted == 1
    assert cache.get(b"b") is None and (cache.hits, cache.misses) == (1, 1)
    assert not cache.put(b"big", "m", answer(16)) and cache.too_big == 1 and b"big" not in cache.entries
    cache.resize(5 * KiB + 2 * ENTRY_OVERHEAD)          # a smaller size (a reload): the oldest go
    assert list(cache.entries) == [b"d"]
    cache.put(b"e", "other", answer(1))
    assert cache.forget("m") == 4 * KiB + ENTRY_OVERHEAD and list(cache.entries) == [b"e"]
    assert cache.clear() == 1 * KiB + ENTRY_OVERHEAD and cache.bytes == 0 and not cache.entries
    off = ResponseCache(0)
    assert not off.enabled and not off.put(b"a", "m", answer(1)) and off.get(b"a") is None


def test_an_answer_is_kept_as_its_own_read_only_copy():
    batch = np.arange(64, dtype=np.float32).reshape(16, 4)
    row = batch[3:4]                                    # a request's rows of its batch's output: a view
    cache = ResponseCache(1 << 20)
    cache.put(b"k", "m", {"y": row})
    kept = cache.get(b"k")["y"]
    assert kept.base is None and not kept.flags.writeable and kept.nbytes == 16   # not the whole batch
    batch[3] = -1                                       # the batch's buffer used again
    assert kept.tolist() == [[12.0, 13.0, 14.0, 15.0]]
    with pytest.raises(ValueError):
        kept[0, 0] = 5.0
    assert cache.bytes == 16 + ENTRY_OVERHEAD


# -- from a Triton configuration ------------------------------------------------------------------------

def test_a_configs_response_cache_is_imported_and_refused_where_triton_refuses_it(tmp_path):
    save("tiny-cnn", tmp_path / "c" / "1" / "model.onnx")
    (tmp_path / "c" / "config.pbtxt").write_text("max_batch_size: 8\ndynamic_batching { }\n"
                                                 "response_cache { enable: true }")
    plan = plan_model(tmp_path / "c", model_io)
    assert plan.serving["response_cache"] is True and plan.not_honoured == []
    assert plan.batching_text().endswith(", response cache")
    check_serving(plan.serving)
    assert plan.config["response_cache"] == {"enable": True}      # ModelConfig says it, as Triton's
    (tmp_path / "c" / "config.pbtxt").write_text("max_batch_size: 8\nresponse_cache { enable: false }")
    assert "response_cache" not in plan_model(tmp_path / "c", model_io).serving
    (tmp_path / "c" / "config.pbtxt").write_text(
        "max_batch_size: 8\nmodel_transaction_policy { decoupled: true }\nresponse_cache { enable: true }")
    with pytest.raises(InputError, match="Response Cache does not currently support model c with 'decoupled'"):
        plan_model(tmp_path / "c", model_io)
    for wrong in ({"response_cache": 1}, {"response_cache": True, "sequence": {}}):
        with pytest.raises(ValueError, match="response_cache|response cache"):
            check_serving(wrong)


# -- a real daemon ------------------------------------------------------------------------------------

def model_statistics(client, name: str) -> dict:
    import tritonclient.grpc as grpcclient
    as_json = {"as_json": True} if isinstance(client, grpcclient.InferenceServerClient) else {}   # (HTTP: JSON)
    stats = client.get_inference_statistics(name, **as_json)["model_stats"][0]
    infer = stats["inference_stats"]
    return {"hits": int(infer["cache_hit"].get("count", 0)), "misses": int(infer["cache_miss"].get("count", 0)),
            "success": int(infer["success"].get("count", 0)), "executions": int(stats.get("execution_count", 0)),
            "computed": int(infer["compute_infer"].get("count", 0)), "hit_ns": int(infer["cache_hit"].get("ns", 0))}


def test_repeated_inputs_are_answered_from_the_cache_across_fronts_and_clients(tmp_path):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    repo = tmp_path / "models"
    config = "max_batch_size: 8\ndynamic_batching { }\n"
    save("tiny-cnn", repo / "cached" / "1" / "model.onnx")
    put_model(repo, "cached", None, config + "response_cache { enable: true }")
    save("tiny-cnn", repo / "plain" / "1" / "model.onnx")
    put_model(repo, "plain", None, config)
    save("tiny-cnn", repo / "short" / "1" / "model.onnx")    # no batching: a front runs it itself once measured
    put_model(repo, "short", None, 'max_batch_size: 0\ninput [ { name: "input" data_type: TYPE_FP32 dims: '
              '[ 1, 3, 32, 32 ] } ]\noutput [ { name: "logits" data_type: TYPE_FP32 dims: [ 1, 10 ] } ]\n'
              "response_cache { enable: true }")
    settings = tmp_path / "modelcache.toml"
    settings.write_text('response_cache_size = "1M"\n')
    d, grpc_at, http_at = start_importing(tmp_path, repo, {"MODELCACHE_CONFIG": str(settings)})
    try:
        ref = ort.InferenceSession(str(repo / "cached" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        a, b = (rng.standard_normal((1, 3, 32, 32)).astype(np.float32) for _ in range(2))
        expected = {id(x): ref.run(None, {"input": x})[0] for x in (a, b)}
        g = grpcclient.InferenceServerClient(grpc_at)
        h = httpclient.InferenceServerClient(http_at)

        def infer(module, client, model, x):
            i = module.InferInput("input", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            return client.infer(model, [i]).as_numpy("logits")

        def settled(client, model, **expected):   # (a front reports what its own cache answered once a second)
            wait_until(lambda: all(model_statistics(client, model)[k] == v for k, v in expected.items()), 10,
                       f"{model}'s statistics to say {expected}")
            return model_statistics(client, model)

        for _ in range(3):     # the first runs on the daemon; the gRPC front answers the others from its own cache
            np.testing.assert_allclose(infer(grpcclient, g, "cached", a), expected[id(a)], rtol=1e-5, atol=1e-6)
        s = settled(g, "cached", hits=2)
        assert (s["hits"], s["misses"], s["success"], s["executions"], s["computed"]) == (2, 1, 3, 1, 1), s
        assert s["hit_ns"] > 0
        # other inputs are another answer; the same inputs through the HTTP front are the same one (the daemon's
        # cache is every front's)
        np.testing.assert_allclose(infer(grpcclient, g, "cached", b), expected[id(b)], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(infer(httpclient, h, "cached", a), expected[id(a)], rtol=1e-5, atol=1e-6)
        s = settled(h, "cached", hits=3, misses=2)
        assert (s["executions"], s["success"]) == (2, 5), s
        with d.client() as c:   # and a serve-mode client's request too, told it was cached
            outputs, timings = c.infer("cached", {"input": b})
            np.testing.assert_allclose(outputs["logits"], expected[id(b)], rtol=1e-5, atol=1e-6)
            assert timings.get("cached") is True and timings["stages"] == []
            assert c.stats().executor["response_cache"]["entries"] == 2
        for _ in range(3):      # a model that did not ask is never cached
            infer(grpcclient, g, "plain", a)
        assert model_statistics(g, "plain")["hits"] == 0
        # a model the front runs itself (once the daemon has timed it): its answers kept at the front as well
        sent = [0]

        def short(x):
            sent[0] += 1
            np.testing.assert_allclose(infer(grpcclient, g, "short", x), ref.run(None, {"input": x})[0],
                                       rtol=1e-5, atol=1e-6)

        def front_holds_short() -> bool:
            short(rng.standard_normal((1, 3, 32, 32)).astype(np.float32))
            with d.client() as c:
                return next(m for m in c.list() if m["name"] == "short")["refcount"] > 0

        wait_until(front_holds_short, 20, "the gRPC front running short itself")
        before = settled(g, "short", success=sent[0])
        y = rng.standard_normal((1, 3, 32, 32)).astype(np.float32)
        for _ in range(3):
            short(y)
        after = settled(g, "short", success=sent[0])
        assert [after[k] - before[k] for k in ("hits", "misses", "executions")] == [2, 1, 1], (before, after)
        status = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=d.env, capture_output=True,
                                text=True, timeout=60)
        assert f"response cache: {4 + after['hits']} hits, {2 + after['misses']} misses;" in status.stdout, \
            status.stdout
        # a reload to size 0: the daemon's answers go, and every request runs again (a front learns it with the
        # model's description, within INTERFACE_TTL_S, and drops its own)
        settings.write_text('response_cache_size = "0"\n')
        os.kill(d.pid, signal.SIGHUP)
        wait_until(lambda: "response_cache_size" in d.log_path.read_text(), 15, "the reload")
        with d.client() as c:
            assert c.stats().executor["response_cache"]["entries"] == 0
        wait_until(lambda: infer(grpcclient, g, "cached", a) is not None and
                   model_statistics(g, "cached")["executions"] >= 3, 15, "a request that runs again")
        ran = model_statistics(g, "cached")["executions"]
        infer(grpcclient, g, "cached", a)
        settled(g, "cached", executions=ran + 1)   # (run, not answered from any cache)
        # back on, an answer kept; the model removed: its answers go with it
        settings.write_text('response_cache_size = "1M"\n')
        os.kill(d.pid, signal.SIGHUP)
        wait_until(lambda: d.log_path.read_text().count("response_cache_size") >= 2, 15, "the second reload")
        with d.client() as c:   # (a front that ran the model itself while the cache was off may for a moment more)
            c.infer("cached", {"input": a})
            assert c.stats().executor["response_cache"]["entries"] == 1
            c.remove("cached", 1)
            assert c.stats().executor["response_cache"]["entries"] == 0
        g.close()
        h.close()
    finally:
        stop_cleanly(d)


def test_add_response_cache_declares_it_with_a_daemon_or_without(tmp_path, zoo_file):
    """`modelcache add --response-cache`: through the daemon, and packed offline for the next daemon to serve."""
    from conftest import DaemonProcess
    src = zoo_file("tiny-cnn")
    x = np.ones((1, 3, 32, 32), np.float32)
    d = DaemonProcess(tmp_path)
    offline = subprocess.run([sys.executable, "-m", "modelcache.cli", "add", src, "--name", "early",
                              "--response-cache"], env=d.env, capture_output=True, text=True, timeout=120)
    assert offline.returncode == 0 and "no daemon running" in offline.stdout, offline.stdout + offline.stderr
    d.start()
    try:
        online = subprocess.run([sys.executable, "-m", "modelcache.cli", "add", src, "--name", "late",
                                 "--response-cache"], env=d.env, capture_output=True, text=True, timeout=120)
        assert online.returncode == 0, online.stdout + online.stderr
        with d.client() as c:
            c.add(src, "plain")
            for name in ("early", "late", "plain"):
                first, _ = c.infer(name, {"input": x})
                again, timings = c.infer(name, {"input": x})
                np.testing.assert_array_equal(first["logits"], again["logits"])
                assert bool(timings.get("cached")) is (name != "plain"), (name, timings)
    finally:
        stop_cleanly(d)


def test_a_front_drops_its_answers_once_the_daemon_says_it_dropped_its_own():
    """Memory pressure reaches a front's cache through its report's reply (FrontServedReply.answers_dropped). The
    daemon's side is the real one in test_front_runs.py (its reply, a count of 0); here a stand-in link answers as a
    daemon under pressure would, which no test here can bring about on cue."""
    import asyncio
    from modelcache.config import Settings
    from modelcache.oip.front_runs import FrontRunner
    from modelcache.wire import protocol as P

    class Link:   # the daemon's replies to the front's reports
        def __init__(self):
            self.dropped, self.reports = 0, 0

        async def call(self, msg, expect, timeout_s=None, on_sent=None):
            assert isinstance(msg, P.FrontServed) and P.FrontServedReply in expect
            self.reports += 1
            return P.FrontServedReply(req_id=msg.req_id, answers_dropped=self.dropped)

    link, answers = Link(), ResponseCache(1 << 20)
    runner = FrontRunner(link, Settings(), "test", answers=answers)

    async def report():
        await runner._report()

    asyncio.run(report())
    assert link.reports == 0                 # nothing to say, nothing held: no report
    answers.put(b"k", "m", answer(4))
    link.dropped = 3                         # drops before this front held anything: not its to act on
    asyncio.run(report())
    assert link.reports == 1 and b"k" in answers.entries
    link.dropped = 4                         # pressure since: the front's answers go too
    asyncio.run(report())
    assert link.reports == 2 and not answers.entries and answers.bytes == 0
