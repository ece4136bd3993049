"""The GPU tier end to end: a real daemon with simulated GPUs (`fake_gpus`), real clients, real ORT.

A simulated device is memory the daemon allocates in its own /dev/shm directory and exports by
file name instead of a CUDA IPC handle; everything else — the device tier's bookkeeping, promotion
through the host tier, GPU leases, eviction under leases, demotion, the open reply, the client's
handle cache and its DLPack OrtValues — is the code a real GPU runs. Outputs are compared with
plain ONNX Runtime. The CUDA-only parts are covered by the `gpu`-marked tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import modelcache
from modelcache.errors import CapacityError, ModelCacheError

from conftest import HERE, TINY, DaemonProcess, stop_cleanly, wait_until

CUDA = ["CUDAExecutionProvider"]


def feeds_for(path: str) -> dict:
    from modelcache import zoo
    return zoo.sample_inputs(path)


def plain(path: str, feeds: dict) -> list:
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.fixture
def gpu_daemon(tmp_path, monkeypatch):
    """A daemon with one simulated 64 MiB GPU; this test process is its client, told of the fake GPU too."""
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    d = DaemonProcess(tmp_path, {"MODELCACHE_FAKE_GPUS": "1x64M"}).start()
    yield d
    stop_cleanly(d)


def gpu_tier(stats) -> dict:
    return next(t for t in stats.tiers if t["tier"] == "gpu")


def model_info(client, name) -> dict:
    return next(m for m in client.list() if m["name"] == name)


def test_gpu_open_runs_on_device_memory_and_matches_plain_ort(gpu_daemon, zoo_file):
    with gpu_daemon.client() as c:
        for name in TINY:
            c.add(zoo_file(name), name)
        for name in TINY:
            feeds = feeds_for(zoo_file(name))
            with modelcache.InferenceSession(name, providers=CUDA, client=c) as sess:
                assert sess.device == "fake-0"
                assert not sess.was_cache_hit             # disk -> host -> device
                got = sess.run(None, feeds)
            for a, b in zip(got, plain(zoo_file(name), feeds)):
                tol = 1e-3 if a.dtype == np.float16 else 1e-5   # plain ORT fuses: another summation order
                np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=name)
            with modelcache.InferenceSession(name, providers=CUDA, client=c) as again:
                assert again.was_cache_hit
                # A run its EP fails is not retried on the CPU over device weights (ORT has no getter for this)
                assert again._sess._enable_fallback is False
            assert model_info(c, name)["tier"] == "gpu"
        # The default provider list keeps the host-tier path.
        with modelcache.InferenceSession("tiny-cnn", client=c) as cpu:
            assert cpu.device == "cpu" and cpu._sess._enable_fallback is True   # (ORT's default, as it was)


def test_gpu_leases_block_eviction_and_status_shows_them(gpu_daemon, zoo_file):
    with gpu_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        sess = modelcache.InferenceSession("cnn", providers=CUDA, client=c)
        st = c.stats()
        tier = gpu_tier(st)
        assert tier["leased"] == {"cnn@1": 1} and tier["used_bytes"] > 0
        assert model_info(c, "cnn")["gpu"] == [{"device": "fake-0", "state": "resident", "leases": 1}]
        with pytest.raises(CapacityError, match="in use by 1 GPU session on"):
            c.evict("cnn", tier="gpu")
        with pytest.raises(CapacityError, match="in use"):
            c.evict("cnn")
        out = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=gpu_daemon.env,
                             capture_output=True, text=True, timeout=60)
        assert "GPU 0 fake-gpu fake-0; held: cnn@1 (1 lease)" in out.stdout, out.stdout + out.stderr
        sess.close()
        c.evict("cnn", tier="gpu")                  # demoted: the host copy stays
        info = model_info(c, "cnn")
        assert info["tier"] == "host" and info["gpu"] == []
        assert gpu_tier(c.stats())["used_bytes"] == 0
        with modelcache.InferenceSession("cnn", providers=CUDA, client=c) as s2:
            assert not s2.was_cache_hit             # promoted again, from the host tier
        c.evict("cnn")                              # host eviction frees the GPU copy first
        assert model_info(c, "cnn")["tier"] == "disk"


def test_gpu_capacity_demotes_unleased_models_and_makes_an_open_wait_while_all_are_leased(tmp_path, monkeypatch):
    """A device with room for one model: an unleased copy is demoted for another; while the copy there is
    leased, another client's GPU open waits for room (`ls` says so) and succeeds once the first client closes
    its session; an open whose deadline passes first is refused, naming what held the device."""
    import threading

    import onnx
    from modelcache import zoo
    from modelcache.store.packing import pack
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    repo = tmp_path / "repo"
    sizes = []
    for scale, name in ((1.0, "a"), (2.0, "b")):    # same architecture, no tensor in common: nothing to share
        model = zoo.build("tiny-vit", 0)
        for t in model.graph.initializer:
            arr = onnx.numpy_helper.to_array(t)
            if arr.dtype == np.float32:
                t.CopyFrom(onnx.numpy_helper.from_array(arr * scale + (scale - 1) / 4, t.name))
        src = tmp_path / f"{name}.onnx"
        onnx.save(model, str(src))
        sizes.append(sum(-(-t.nbytes // 256) * 256 for t in pack(str(src), repo, name, 1).gpu_tensors))
    capacity = int(1.5 * max(sizes))                # room for one model at a time
    conf = tmp_path / "modelcache.toml"             # (a file, so that a reload can change it)
    conf.write_text(f'gpu_capacity = "{capacity}"\n')
    d = DaemonProcess(tmp_path, {"MODELCACHE_FAKE_GPUS": "1x64M", "MODELCACHE_CONFIG": str(conf)}).start()
    try:
        with d.client() as c, d.client() as other, d.client(timeout_s=5.0) as hasty:
            c.load("a", tier="gpu")
            c.load("b", tier="gpu")                 # does not fit beside a: a (unleased) is demoted
            assert model_info(c, "a")["tier"] == "host" and model_info(c, "b")["tier"] == "gpu"
            held = modelcache.InferenceSession("b", providers=CUDA, client=c)
            with pytest.raises(CapacityError, match=r"^waited 4\.5 s for room, until the request's deadline: a@1 "
                                                    r"needs .* b@1 \(in use by 1 GPU session\).*gpu_capacity"):
                hasty.open("a", device="cuda")      # (its client's timeout, 5 s, less a margin: its deadline; with 2 s
                                                    # the 0.2 s margin was too thin on a loaded machine)
            got = []
            t = threading.Thread(target=lambda: got.append(other.open("a", device="cuda")))
            t.start()
            wait_until(lambda: model_info(c, "a")["gpu"] == [{"device": "fake-0", "state": "waiting", "leases": 0}],
                       30, "a's GPU open waiting for room")
            out = subprocess.run([sys.executable, "-m", "modelcache.cli", "ls"], env=d.env, capture_output=True,
                                 text=True, timeout=60)
            assert "waiting for room on GPU 0 (1 request)" in out.stdout, out.stdout + out.stderr
            out = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=d.env, capture_output=True,
                                 text=True, timeout=60)
            gpu_line = next(line for line in out.stdout.splitlines() if line.startswith("gpu "))
            assert gpu_line.endswith("; 1 request waiting for room (1 model)"), out.stdout + out.stderr
            assert got == [] and model_info(c, "b")["gpu"][0]["leases"] == 1
            held.close()                            # room: a's open goes on, b is demoted
            t.join(30)
            assert len(got) == 1 and got[0].name == "a" and got[0].device_uuid == "fake-0" and not got[0].hit
            assert model_info(c, "a")["tier"] == "gpu" and model_info(c, "b")["tier"] == "host"
            # Leased again, a fills the device; b's open waits until a reload gives the tier room for both.
            t = threading.Thread(target=lambda: got.append(c.open("b", device="cuda")))
            t.start()
            wait_until(lambda: model_info(c, "b")["gpu"] == [{"device": "fake-0", "state": "waiting", "leases": 0}],
                       30, "b's GPU open waiting for room")
            conf.write_text(f'gpu_capacity = "{3 * capacity}"\n')
            d.proc.send_signal(signal.SIGHUP)
            t.join(30)
            assert len(got) == 2 and got[1].name == "b" and got[1].device_uuid == "fake-0"
            assert model_info(c, "a")["gpu"][0]["leases"] == 1 and model_info(c, "b")["tier"] == "gpu"
            assert f"reload: gpu_capacity '{capacity}' -> '{3 * capacity}'" in d.log_path.read_text()
            c.release(got[1].lease_id)
            other.release(got[0].lease_id)
    finally:
        assert d.stop() == 0, d.log_path.read_text()
        d.kill()


def test_a_killed_gpu_client_releases_its_lease(gpu_daemon, zoo_file):
    with gpu_daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        env = {**os.environ, "MODELCACHE_SOCKET": gpu_daemon.socket, "MODELCACHE_FAKE_GPUS": "1x64M"}
        proc = subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "hold", "cnn", "cuda"], env=env,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "OPEN"
            assert model_info(c, "cnn")["gpu"][0]["leases"] == 1
        finally:
            proc.kill()
            proc.wait()
        wait_until(lambda: model_info(c, "cnn")["gpu"][0]["leases"] == 0, what="the dead client's GPU lease released")
        c.evict("cnn", tier="gpu")


def test_shared_tensors_are_on_the_device_once(gpu_daemon, zoo_file, tmp_path):
    import onnx
    from test_tiers import variant
    with gpu_daemon.client() as c:
        for i, name in enumerate(("base", "tuned")):
            path = tmp_path / f"{name}.onnx"
            onnx.save(variant(1, change_last=2 * i), str(path))
            c.add(str(path), name)
        c.load("base", tier="gpu")
        one = gpu_tier(c.stats())["used_bytes"]
        c.load("tuned", tier="gpu")
        both = gpu_tier(c.stats())["used_bytes"]
        assert one < both < 1.5 * one               # the fine-tuned variant adds only the layers it changed


def test_weights_on_the_device_are_not_written_by_clients(gpu_daemon, zoo_file):
    """Read-only by contract: many runs from several sessions leave the device bytes as they were."""
    with gpu_daemon.client() as c:
        c.add(zoo_file("tiny-vit"), "vit")
        c.load("vit", tier="gpu")
        lease = c.open("vit", device="cuda")
        files = [Path(h.decode()) for h in lease.ipc_handles]
        before = [f.read_bytes() for f in files]
        feeds = feeds_for(zoo_file("tiny-vit"))
        sessions = [modelcache.InferenceSession("vit", providers=CUDA, client=c) for _ in range(3)]
        for _ in range(20):
            for s in sessions:
                s.run(None, feeds)
        for s in sessions:
            s.close()
        c.release(lease.lease_id)
        assert [f.read_bytes() for f in files] == before


def test_gpu_requests_without_a_gpu_tier_are_clear_errors(daemon, zoo_file):
    with daemon.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        with pytest.raises(ModelCacheError, match="no GPU tier"):
            c.open("cnn", device="cuda")
        with pytest.raises(ModelCacheError, match="no GPU tier"):
            c.load("cnn", tier="gpu")
        with pytest.raises(ModelCacheError, match="unknown device"):
            c.open("cnn", device="tpu")


def test_cli_load_and_evict_gpu_tier(gpu_daemon, zoo_file):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "modelcache.cli", *args], env=gpu_daemon.env,
                              capture_output=True, text=True, timeout=120)
    assert cli("add", zoo_file("tiny-cnn"), "--name", "cnn").returncode == 0
    out = cli("load", "cnn", "--tier", "gpu:0")
    assert out.returncode == 0 and out.stdout.startswith("loaded cnn@1 into the host tier and GPU "), out.stderr
    out = cli("load", "cnn", "--tier", "gpu:7")
    assert out.returncode != 0 and "no GPU '7'" in out.stderr
    out = cli("evict", "cnn", "--tier", "gpu")
    assert out.returncode == 0 and out.stdout.startswith("demoted cnn@1 from GPU ") and \
        out.stdout.rstrip().endswith("; it stays in the host tier"), out.stdout + out.stderr
    assert cli("evict", "cnn", "--tier", "disk").returncode == 2      # argparse: not a tier


def test_gpu_session_keeps_running_when_the_daemon_dies(tmp_path, monkeypatch, zoo_file):
    """The memory a client maps outlives the daemon (as CUDA keeps imported memory alive, shared/GPU.md)."""
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    d = DaemonProcess(tmp_path, {"MODELCACHE_FAKE_GPUS": "1x64M"}).start()
    try:
        c = d.client()
        c.add(zoo_file("tiny-cnn"), "cnn")
        feeds = feeds_for(zoo_file("tiny-cnn"))
        sess = modelcache.InferenceSession("cnn", providers=CUDA, client=c)
        before = sess.run(None, feeds)
        d.proc.kill()
        d.proc.wait()
        after = sess.run(None, feeds)
        for a, b in zip(before, after):
            np.testing.assert_array_equal(a, b)
        sess.close()    # the lease cannot be released: the daemon is gone, and close says nothing of it
        c.close()
    finally:
        d.kill()
