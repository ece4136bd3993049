"""Triton's repository load as it serves (triton_repo/load.py): a model copied into the Triton repository after
the daemon started is loaded by name; one whose config.pbtxt changed is reloaded; a `config` parameter replaces
config.pbtxt, and `file:` parameters with one bring a model the repository does not have. Through tritonclient,
both protocols, against a real daemon that imported the repository at start, with its two fronts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo

from conftest import stop_cleanly, wait_until
from test_triton_repo import put_model, start_importing

CONFIG = """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] } ]
"""


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """(daemon, Triton repository, gRPC host:port, HTTP host:port): one model, `first`, imported at start."""
    root = tmp_path_factory.mktemp("load")
    repo = root / "models"
    put_model(repo, "first", zoo.build("tiny-cnn", seed=1), CONFIG)
    d, grpc_at, http_at = start_importing(root, repo)
    try:
        yield d, repo, grpc_at, http_at
    finally:
        stop_cleanly(d)


@pytest.fixture
def clients(serving):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    d, repo, grpc_at, http_at = serving
    g, h = grpcclient.InferenceServerClient(grpc_at), httpclient.InferenceServerClient(http_at)
    try:
        yield d, repo, g, h
    finally:
        g.close()
        h.close()


def answer(client, name: str, x: np.ndarray) -> np.ndarray:
    import tritonclient.grpc as grpcclient
    i = grpcclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return client.infer(name, [i]).as_numpy("logits")


def want(model_file, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(model_file)).run(None, {"input": x})[0]


X = np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32)


def refused(call, *args, **kwargs):
    from tritonclient.utils import InferenceServerException
    with pytest.raises(InferenceServerException) as e:
        call(*args, **kwargs)
    return e.value


def test_a_model_copied_into_the_repository_after_the_start_is_loaded_by_name(serving, clients):
    d, repo, g, h = clients
    put_model(repo, "later", zoo.build("tiny-cnn", seed=2), CONFIG)
    assert not g.is_model_ready("later")
    # Listed before it is loaded, by its name alone, as Triton lists a model it has not loaded
    assert {"name": "later"} in h.get_model_repository_index()
    [entry] = [m for m in g.get_model_repository_index().models if m.name == "later"]
    assert (entry.version, entry.state) == ("", "")
    import urllib.request
    asked = urllib.request.Request(f"http://{serving[3]}/v2/repository/index", data=b'{"ready": true}',
                                   method="POST")
    with urllib.request.urlopen(asked, timeout=10) as r:   # (only what is ready: not a model never loaded)
        assert "later" not in [m["name"] for m in json.loads(r.read())]
    g.load_model("later")
    assert g.is_model_ready("later") and h.is_model_ready("later")
    np.testing.assert_allclose(answer(g, "later", X), want(repo / "later" / "1" / "model.onnx", X), rtol=1e-4,
                               atol=1e-5)
    assert g.get_model_config("later", as_json=True)["config"]["max_batch_size"] == 4
    assert "later: imported version 1" in d.log_path.read_text()
    h.load_model("later")   # again, unchanged: nothing imported, the model still served
    assert "later@1: unchanged, not imported again" in d.log_path.read_text()
    np.testing.assert_allclose(answer(g, "later", X), want(repo / "later" / "1" / "model.onnx", X), rtol=1e-4,
                               atol=1e-5)


def test_a_changed_model_is_reloaded_and_a_config_override_replaces_config_pbtxt_until_the_next_load(clients):
    d, repo, g, h = clients
    put_model(repo, "changing", zoo.build("tiny-cnn", seed=3), CONFIG)
    h.load_model("changing")
    # The operator edits config.pbtxt and swaps the file, then loads: the version is replaced.
    put_model(repo, "changing", zoo.build("tiny-cnn", seed=4), CONFIG.replace("max_batch_size: 4", "max_batch_size: 2"))
    h.load_model("changing")
    assert "changing@1: changed since its import" in d.log_path.read_text()
    assert h.get_model_config("changing")["max_batch_size"] == 2
    np.testing.assert_allclose(answer(g, "changing", X), want(repo / "changing" / "1" / "model.onnx", X),
                               rtol=1e-4, atol=1e-5)
    with pytest.raises(Exception, match="max_batch_size is 2"):
        answer(g, "changing", np.zeros((3, 3, 32, 32), np.float32))
    # A config override (as Model Analyzer sends it): in place of config.pbtxt, over the repository's files.
    config = g.get_model_config("changing", as_json=True)["config"]
    config["max_batch_size"] = 3
    config["dynamic_batching"] = {"max_queue_delay_microseconds": 500}
    weights = d.repository / "changing" / "1" / "weights.bin"
    packed = weights.stat().st_ino
    g.load_model("changing", config=json.dumps(config))
    assert "changing@1: its configuration changed since its import, its file did not" in d.log_path.read_text()
    assert weights.stat().st_ino == packed   # (the config alone: in place, not packed again)
    got = g.get_model_config("changing", as_json=True)["config"]
    assert got["max_batch_size"] == 3 and int(got["dynamic_batching"]["max_queue_delay_microseconds"]) == 500
    assert answer(g, "changing", np.zeros((3, 3, 32, 32), np.float32)).shape == (3, 10)
    g.load_model("changing")   # no override: config.pbtxt again, as Triton's next load undoes it
    assert h.get_model_config("changing")["max_batch_size"] == 2


def test_files_with_a_config_bring_a_model_the_repository_does_not_have(clients, tmp_path):
    d, repo, g, h = clients
    model = zoo.build("tiny-cnn", seed=6)
    path = tmp_path / "model.onnx"
    zoo.save(model, str(path))
    config = json.dumps({"name": "sent", "backend": "onnxruntime", "max_batch_size": 4})
    h.load_model("sent", config=config, files={"file:1/model.onnx": path.read_bytes()})        # base64 in JSON
    g.load_model("sent-grpc", config=config.replace('"sent"', '"sent-grpc"'),
                 files={"file:1/model.onnx": path.read_bytes()})                                # bytes_param
    assert not (repo / "sent").exists()
    for name in ("sent", "sent-grpc"):
        np.testing.assert_allclose(answer(g, name, X), want(path, X), rtol=1e-4, atol=1e-5)
        got = h.get_model_config(name)   # auto-completed from the file, as Triton's would be
        assert got["max_batch_size"] == 4 and [i["name"] for i in got["input"]] == ["input"]


def test_a_load_that_cannot_be_carried_out_is_refused_in_tritons_words_and_changes_nothing(clients, tmp_path):
    d, repo, g, h = clients
    zoo.save(zoo.build("tiny-cnn"), str(tmp_path / "m.onnx"))
    onnx_bytes = (tmp_path / "m.onnx").read_bytes()
    before = answer(g, "first", X)
    cases = [  # (parameters, HTTP status, gRPC status, words)
        (dict(files={"file:1/model.onnx": onnx_bytes}), "400", "StatusCode.INVALID_ARGUMENT",
         "Load parameter 'config' must be specified for model file override"),
        (dict(config="{not json"), "400", "StatusCode.INVALID_ARGUMENT", "Invalid config override: "),
        (dict(config='{"max_batch_size": 4, "no_such_field": 1}'), "400", "StatusCode.INVALID_ARGUMENT",
         "no_such_field"),
        (dict(config="{}", files={"file:../../escape.onnx": onnx_bytes}), "400", "StatusCode.INVALID_ARGUMENT",
         "must stay within model directory"),
        (dict(config='{"max_batch_size": 4, "input": [{"name": "input", "data_type": "TYPE_FP32", "dims": [3, 8, 8]}]}'),
         "400", "StatusCode.INVALID_ARGUMENT", "first"),   # dims the model contradicts
    ]
    for params, http_status, grpc_status, words in cases:
        for client, status in ((h, http_status), (g, grpc_status)):
            e = refused(client.load_model, "first", **params)
            assert str(e.status()) == status and words in e.message(), (params, e)
    for name, words in (("..", "must not contain path traversal characters"),
                        (".hidden", "invalid model name '.hidden'")):
        e = refused(g.load_model, name, config="{}", files={"file:1/model.onnx": onnx_bytes})
        assert e.status() == "StatusCode.INVALID_ARGUMENT" and words in e.message(), e
    e = refused(g.load_model, "nowhere")
    assert e.status() == "StatusCode.NOT_FOUND" and "no directory 'nowhere' in the Triton repository" in e.message(), e
    # A file that is not a model: refused with the importer's line; the model as it was is still served.
    e = refused(h.load_model, "first", config=json.dumps({"max_batch_size": 4}), files={"file:1/model.onnx": b"junk"})
    assert "is not a valid ONNX model" in e.message(), e
    assert not (tmp_path.parent / "escape.onnx").exists()
    np.testing.assert_array_equal(answer(g, "first", X), before)


def test_a_version_in_use_is_not_replaced_and_stays_served(clients):
    """A client's attach-mode session holds the version: the reload is refused (UNAVAILABLE, as a full tier
    is), and the version imported before still serves; once the session closes, the same load replaces it."""
    d, repo, g, h = clients
    put_model(repo, "held", zoo.build("tiny-cnn", seed=7), CONFIG)
    g.load_model("held")
    before = answer(g, "held", X)
    with d.client() as c:
        session = modelcache.InferenceSession("held", client=c)
        put_model(repo, "held", zoo.build("tiny-cnn", seed=8), CONFIG)
        e = refused(g.load_model, "held")
        assert e.status() == "StatusCode.UNAVAILABLE" and "in use (1 session)" in e.message(), e
        np.testing.assert_array_equal(answer(g, "held", X), before)
        assert not list((d.repository / "held").glob(".staged-*"))   # (the replacement packed for it is gone)
        session.close()
    g.load_model("held")
    wait_until(lambda: "held@1: changed since its import" in d.log_path.read_text(), 10, "the reload")
    np.testing.assert_allclose(answer(g, "held", X), want(repo / "held" / "1" / "model.onnx", X), rtol=1e-4,
                               atol=1e-5)


SERIAL = """
backend: "onnxruntime"
max_batch_size: 0
input [ { name: "input" data_type: TYPE_FP32 dims: [ -1, 3, 32, 32 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ -1, 10 ] } ]
"""


@pytest.mark.parametrize("config", [CONFIG, SERIAL], ids=["batched", "serial"])
def test_a_model_reloaded_under_traffic_loses_no_request_and_answers_new_once_loaded(serving, clients, config):
    """The changed file is packed while the version serves, then swapped in at once (daemon/swaps.py): requests
    over both fronts meanwhile (a `serial` model the fronts run themselves, over sessions they hold; a `batched`
    one the daemon's engine runs) all succeed, each with the old file's answer or the new one's, and every
    request sent after the load returned has the new one's. (Before: every request in the repack failed NOT_FOUND,
    and a version a front held could not be replaced at all.)"""
    import threading
    import time

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    d, repo, g, _ = clients
    name = f"busy-{'serial' if config is SERIAL else 'batched'}"
    put_model(repo, name, zoo.build("tiny-cnn", seed=11), config)
    g.load_model(name)
    x = X[:1]
    old = want(repo / name / "1" / "model.onnx", x)
    stop, records = threading.Event(), []

    def traffic(module, address):
        c = module.InferenceServerClient(address)
        i = module.InferInput("input", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    records.append((t0, c.infer(name, [i]).as_numpy("logits"), None))
                except Exception as e:
                    records.append((t0, None, str(e)))
        finally:
            c.close()

    threads = [threading.Thread(target=traffic, args=args) for args in
               ((grpcclient, serving[2]), (grpcclient, serving[2]), (httpclient, serving[3]))]
    for t in threads:
        t.start()
    try:
        time.sleep(1.5)   # (long enough for the engine to measure it, and a front to run the serial one)
        put_model(repo, name, zoo.build("tiny-cnn", seed=12), config)
        new = want(repo / name / "1" / "model.onnx", x)
        g.load_model(name)
        loaded = time.monotonic()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert [error for _, _, error in records if error] == []
    assert "replacing the version imported before" in d.log_path.read_text()
    for t0, y, _ in records:
        is_new = np.allclose(y, new, rtol=1e-4, atol=1e-5)
        assert is_new or t0 < loaded and np.allclose(y, old, rtol=1e-4, atol=1e-5)
    assert sum(t0 > loaded for t0, _, _ in records) > 10
    assert not list((d.repository / name).glob(".staged-*"))


def test_loads_of_one_model_at_once_are_carried_out_one_after_the_other(serving, clients):
    """Four clients load a changed model at once: the first replaces it, the others find it unchanged; none fails."""
    from concurrent.futures import ThreadPoolExecutor
    import tritonclient.grpc as grpcclient
    d, repo, g, h = clients
    put_model(repo, "raced", zoo.build("tiny-cnn", seed=11), CONFIG)
    g.load_model("raced")
    put_model(repo, "raced", zoo.build("tiny-cnn", seed=12), CONFIG)

    def load(_):
        c = grpcclient.InferenceServerClient(serving[2])
        try:
            c.load_model("raced")
        finally:
            c.close()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(load, range(4)))
    log = d.log_path.read_text()
    assert log.count("raced@1: changed since its import") == 1 and log.count("raced@1: unchanged") >= 3, log[-3000:]
    np.testing.assert_allclose(answer(g, "raced", X), want(repo / "raced" / "1" / "model.onnx", X), rtol=1e-4,
                               atol=1e-5)


ENSEMBLE = """
platform: "ensemble"
max_batch_size: 4
input [ { name: "IMAGE" data_type: TYPE_FP32 dims: [ 3, 32, 32 ] } ]
output [ { name: "%s" data_type: TYPE_FP32 dims: [ 10 ] } ]
ensemble_scheduling { step [ { model_name: "first" model_version: -1
  input_map { key: "input" value: "IMAGE" } output_map { key: "logits" value: "%s" } } ] }
"""


def test_an_ensemble_is_loaded_and_reloaded_as_a_model_is(clients):
    import tritonclient.grpc as grpcclient
    d, repo, g, h = clients
    put_model(repo, "ens", None, ENSEMBLE % ("SCORES", "SCORES"))
    g.load_model("ens")
    put_model(repo, "ens", None, ENSEMBLE % ("PROBS", "PROBS"))   # its output renamed
    h.load_model("ens")
    i = grpcclient.InferInput("IMAGE", list(X.shape), "FP32")
    i.set_data_from_numpy(X)
    np.testing.assert_allclose(g.infer("ens", [i]).as_numpy("PROBS"), answer(g, "first", X), rtol=1e-5, atol=1e-6)
    assert [o["name"] for o in h.get_model_metadata("ens")["outputs"]] == ["PROBS"]


def test_an_unload_is_one_state_for_both_fronts(clients):
    """Unloaded over HTTP while the gRPC front runs the model: the unload succeeds, both fronts say the model is not
    ready and refuse it (the other within the 2 s its description is kept), the index says so; a load over gRPC
    makes it ready over both."""
    from tritonclient.utils import InferenceServerException
    d, repo, g, h = clients
    put_model(repo, "shared", zoo.build("tiny-cnn", seed=13), CONFIG)
    g.load_model("shared")
    before = answer(g, "shared", X)    # (the gRPC front runs tiny-cnn itself: it holds the model)
    h.unload_model("shared")
    assert not h.is_model_ready("shared")
    wait_until(lambda: not g.is_model_ready("shared"), 5, "the gRPC front to see the unload")
    with pytest.raises(InferenceServerException, match="shared is unloaded: load it first"):
        answer(g, "shared", X)
    for client in (g, h):
        index = client.get_model_repository_index(**({"as_json": True} if client is g else {}))
        entries = index["models"] if client is g else index
        [entry] = [m for m in entries if m["name"] == "shared"]
        assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded"), entry
    g.load_model("shared")
    assert h.is_model_ready("shared") and g.is_model_ready("shared")
    np.testing.assert_array_equal(answer(g, "shared", X), before)


SLOW_WARM = """
backend: "onnxruntime"
max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
model_warmup [ { name: "zeros" batch_size: 1 count: 4
  inputs { key: "x" value { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } } ]
"""


def test_a_model_is_not_ready_while_it_warms_up(clients):
    """As Triton's: a model whose model_warmup runs is not ready (the index says LOADING) until it ends."""
    from test_triton_repo import slow_model
    d, repo, g, h = clients
    put_model(repo, "slowwarm", slow_model(300_000), SLOW_WARM)   # (~0.5 s a run here: 4 runs)
    g.load_model("slowwarm")
    assert not g.is_model_ready("slowwarm") and not h.is_model_ready("slowwarm")
    [entry] = [m for m in h.get_model_repository_index() if m["name"] == "slowwarm"]
    assert (entry["state"], entry["reason"]) == ("LOADING", "warming up (model_warmup)"), entry
    wait_until(lambda: g.is_model_ready("slowwarm"), 120, "the warm-up's end")
    assert "slowwarm@1: warmed up: 4 runs" in d.log_path.read_text()
    assert h.is_model_ready("slowwarm")
    # A changed file swapped in for the ready version: ready all along (as Triton keeps the model it reloads),
    # its warm-up run all the same, ahead of its requests
    put_model(repo, "slowwarm", slow_model(300_001), SLOW_WARM)
    g.load_model("slowwarm")
    assert g.is_model_ready("slowwarm") and h.is_model_ready("slowwarm")
    wait_until(lambda: d.log_path.read_text().count("slowwarm@1: warmed up: 4 runs") == 2, 120, "its warm-up")


def test_versions_the_policy_no_longer_serves_are_removed_at_a_load(clients):
    """Triton's way to update a model under traffic: a new version directory, then a load; with `latest: 1` the
    old version is unloaded, as Triton does (removed here)."""
    d, repo, g, h = clients
    put_model(repo, "rolling", zoo.build("tiny-cnn", seed=9), CONFIG)
    g.load_model("rolling")
    (repo / "rolling" / "2").mkdir()
    zoo.save(zoo.build("tiny-cnn", seed=10), str(repo / "rolling" / "2" / "model.onnx"))
    g.load_model("rolling")
    assert g.get_model_metadata("rolling", as_json=True)["versions"] == ["2"]
    assert "rolling@1: no longer served by its version policy; removed" in d.log_path.read_text()
    np.testing.assert_allclose(answer(g, "rolling", X), want(repo / "rolling" / "2" / "model.onnx", X), rtol=1e-4,
                               atol=1e-5)
    assert not g.is_model_ready("rolling", "1")


@pytest.mark.parametrize("key, words", [
    ("file:/etc/passwd", "must stay within model directory"),
    ("file:1/../../x", "must stay within model directory"),
    ("file:.", "must stay within model directory"),
    ("weights", "Unrecognized load parameter 'weights' with type 'bytes'"),
])
def test_load_parameters_are_checked_as_triton_checks_them(key, words):
    from modelcache.errors import InputError
    from modelcache.triton_repo.load import check_parameters
    with pytest.raises(InputError, match=words):
        check_parameters({"config": "{}", key: b"x"})
    config, files = check_parameters({"config": '{"max_batch_size": 2}', "file:1/./model.onnx": b"m"})
    assert config.max_batch_size == 2 and files == {"1/model.onnx": b"m"}
    with pytest.raises(InputError, match="File parameter 'file:1/model.onnx' must have bytes type"):
        check_parameters({"config": "{}", "file:1/model.onnx": "text"})
    for not_an_object in ("[]", "5", '"max_batch_size"'):   # (protobuf's parser would take them as empty)
        with pytest.raises(InputError, match="Invalid config override: a model configuration is a JSON object"):
            check_parameters({"config": not_an_object})


def test_a_version_directory_past_tritons_int64_is_refused(tmp_path):
    from modelcache.errors import InputError
    from modelcache.triton_repo.versions import present
    (tmp_path / "1").mkdir()
    assert present(tmp_path) == [1]
    (tmp_path / str(1 << 63)).mkdir()
    with pytest.raises(InputError, match="version directory 9223372036854775808: past the largest version"):
        present(tmp_path)


def test_import_triton_refuses_a_changed_version_and_replaces_it_with_replace(tmp_path):
    """The command, with no daemon (straight into the repository): a changed config.pbtxt is refused, naming the
    way to replace it; --replace replaces it and removes the version the policy moved past."""
    import os
    import subprocess
    import sys
    repo = tmp_path / "models"
    put_model(repo, "m", zoo.build("tiny-cnn", seed=1), CONFIG)
    env = {**os.environ, "MODELCACHE_CONFIG": "", "MODELCACHE_SOCKET": f"ipc://{tmp_path}/none.sock",
           "MODELCACHE_REPOSITORY": str(tmp_path / "store")}

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "modelcache.cli", "import-triton", str(repo), *extra],
                              env=env, capture_output=True, text=True, timeout=120)
    assert run().returncode == 0
    every = CONFIG.replace("max_batch_size: 4", "max_batch_size: 2") + "version_policy: { all { } }\n"
    put_model(repo, "m", zoo.build("tiny-cnn", seed=1), every)
    (repo / "m" / "2").mkdir()
    zoo.save(zoo.build("tiny-cnn", seed=2), str(repo / "m" / "2" / "model.onnx"))
    refused_run = run()
    assert refused_run.returncode == 1 and "m@1 is already in modelcache from another file or configuration; " \
        "import with --replace" in refused_run.stdout, refused_run.stdout
    assert not (tmp_path / "store" / "m" / "2").exists()   # (the model whole or not at all)
    weights = tmp_path / "store" / "m" / "1" / "weights.bin"
    packed = weights.stat().st_ino
    replaced = run("--replace")
    assert replaced.returncode == 0 and "m@1: its configuration changed since its import, its file did not: the " \
        "configuration replaced in place" in replaced.stdout, replaced.stdout
    assert weights.stat().st_ino == packed   # (not packed again)
    assert sorted(p.name for p in (tmp_path / "store" / "m").iterdir()) == ["1", "2"]
    (repo / "m" / "config.pbtxt").write_text(CONFIG)   # the default policy again: the latest version only
    replaced = run("--replace")
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert "m@1: no longer served by its version policy; removed" in replaced.stdout, replaced.stdout
    assert sorted(p.name for p in (tmp_path / "store" / "m").iterdir()) == ["2"]


def test_a_files_reads_are_kept_until_it_changes(tmp_path):
    """A load reads every version's file again: what it read is kept by the file's identity and times, and read
    again once the file is written or replaced (even to the same size, in the same second)."""
    from modelcache.triton_repo import importer
    path = tmp_path / "f"
    path.write_bytes(b"a" * 10)
    reads = []

    def read(p):
        reads.append(p)
        return [Path(p).read_bytes()]
    first = importer._by_file(path, "test", read)
    assert importer._by_file(path, "test", read) == first and len(reads) == 1
    first.append("changed by the caller")   # (a copy: the kept answer is not changed)
    assert importer._by_file(path, "test", read) == [b"a" * 10]
    path.write_bytes(b"b" * 10)
    assert importer._by_file(path, "test", read) == [b"b" * 10] and len(reads) == 2
    (tmp_path / "g").write_bytes(b"c" * 10)
    (tmp_path / "g").replace(path)
    assert importer._by_file(path, "test", read) == [b"c" * 10] and len(reads) == 3


# -- Triton's poll mode (triton_repo/poll.py) ------------------------------------------------------------------

def test_a_pass_imports_what_is_new_or_changed_and_says_what_went(tmp_path):
    """The poller's passes over a repository written here; `import_models` records what each pass asks for."""
    from modelcache.errors import DaemonUnavailable
    from modelcache.triton_repo.poll import RepositoryPoller
    repo = tmp_path / "models"
    for name in ("a", "b"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.onnx").write_bytes(b"x")
    asked, lines, fail = [], [], []

    def import_models(names):
        if fail:
            raise DaemonUnavailable("no daemon answers")
        asked.append(names)
    poller = RepositoryPoller(repo, import_models, lines.append)
    assert poller.poll_once() == ["a", "b"]       # the first pass: everything
    assert poller.poll_once() == [] and asked == [["a", "b"]]
    (repo / "a" / "config.pbtxt").write_text("max_batch_size: 2")    # a file added
    (repo / "c" / "1").mkdir(parents=True)                            # a model added
    assert poller.poll_once() == ["a", "c"]
    (repo / "b" / "1" / "model.onnx").write_bytes(b"y")              # a file rewritten, same size
    fail.append(True)                                                 # ... while the daemon is away
    assert poller.poll_once() == ["b"] and "no daemon answers; trying again at the next pass" in lines[-1]
    fail.clear()
    assert poller.poll_once() == ["b"]                                # tried again
    import shutil
    shutil.rmtree(repo / "c")
    assert poller.poll_once() == [] and lines[-1].startswith("c: its directory is gone")
    assert asked == [["a", "b"], ["a", "c"], ["b"]]
    # With a daemon's unload: the model whose directory went is unloaded, and loaded when it is back
    switched = []
    watching = RepositoryPoller(repo, import_models, lines.append, lambda n, u: switched.append((n, u)))
    watching.poll_once()
    shutil.move(repo / "a", tmp_path / "a")
    watching.poll_once()
    assert switched == [("a", True)] and "a: its directory is gone" in lines[-1] and "unloaded" in lines[-1]
    shutil.move(tmp_path / "a", repo / "a")
    assert watching.poll_once() == ["a"] and switched == [("a", True), ("a", False)]
    assert lines[-1].startswith("a: back in")
    slept = []
    RepositoryPoller(repo, import_models, lines.append).run(0.5, sleep=slept.append, passes=3)
    assert slept == [0.5, 0.5] and asked[-1] == ["a", "b"]


def test_poll_mode_needs_a_triton_repository():
    from modelcache.config import ConfigError, load
    with pytest.raises(ConfigError, match="model_control poll watches the Triton repository: set triton_repository"):
        load(None, env={"MODELCACHE_MODEL_CONTROL": "poll", "MODELCACHE_CONFIG": ""})
    assert load(None, env={"MODELCACHE_CONFIG": ""}).model_control == "explicit"


def test_a_daemon_that_polls_its_triton_repository_imports_what_changes(tmp_path):
    """model_control poll: a model copied in is served, an edited config.pbtxt configures it in place, a
    broken file is refused with its line and the version before keeps serving; no load asked for."""
    import tritonclient.grpc as grpcclient
    repo = tmp_path / "models"
    put_model(repo, "first", zoo.build("tiny-cnn", seed=1), CONFIG)
    d, grpc_at, _ = start_importing(tmp_path, repo, {"MODELCACHE_MODEL_CONTROL": "poll",
                                                         "MODELCACHE_REPOSITORY_POLL_S": "0.2"})
    g = grpcclient.InferenceServerClient(grpc_at)
    try:
        put_model(repo, "second", zoo.build("tiny-cnn", seed=2), CONFIG)
        wait_until(lambda: "second: imported version 1" in d.log_path.read_text(), 60, "the poll's import")
        np.testing.assert_allclose(answer(g, "second", X), want(repo / "second" / "1" / "model.onnx", X),
                                   rtol=1e-4, atol=1e-5)
        (repo / "second" / "config.pbtxt").write_text(CONFIG.replace("max_batch_size: 4", "max_batch_size: 2"))
        wait_until(lambda: "second@1: its configuration changed" in d.log_path.read_text(), 60, "the poll's reload")
        assert g.get_model_config("second", as_json=True)["config"]["max_batch_size"] == 2
        # As Triton's poll mode: the repository API's loads and unloads refused, in its words
        for call in (g.load_model, g.unload_model):
            e = refused(call, "second")
            assert e.status() == "StatusCode.UNAVAILABLE" and \
                "explicit model load / unload is not allowed if polling is enabled" in e.message(), e
        before = answer(g, "first", X)
        (repo / "first" / "1" / "model.onnx").write_bytes(b"half a copy")
        wait_until(lambda: "is not a valid ONNX model" in d.log_path.read_text(), 60, "the poll's refusal")
        np.testing.assert_array_equal(answer(g, "first", X), before)
        # A directory that goes: unloaded, as Triton unloads it (its versions kept); back, it is loaded again
        import shutil
        shutil.move(repo / "second", tmp_path / "second-aside")
        wait_until(lambda: not g.is_model_ready("second"), 60, "the unload of a model whose directory went")
        e = refused(answer, g, "second", X)
        assert "unloaded" in e.message(), e
        assert (d.repository / "second" / "1").is_dir()
        shutil.move(tmp_path / "second-aside", repo / "second")
        wait_until(lambda: g.is_model_ready("second"), 60, "its load when it came back")
        # (the poller says so once the daemon has it loaded: just after it is ready)
        wait_until(lambda: "second: back in" in d.log_path.read_text(), 10, "the poller's line")
        np.testing.assert_allclose(answer(g, "second", X), want(repo / "second" / "1" / "model.onnx", X),
                                   rtol=1e-4, atol=1e-5)
    finally:
        g.close()
        stop_cleanly(d)
