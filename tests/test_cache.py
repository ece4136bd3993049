"""The tiered cache against a real daemon: oversubscription, eviction, pinning, shared tensors, remote store."""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo
from modelcache.errors import CapacityError, ModelNotFound, RemoteError
from conftest import HERE, DaemonProcess
from test_tiers import variant

SEGMENT_BYTES = 323584   # one tiny-vit in the host tier (page-aligned tensors)


@pytest.fixture
def vits(tmp_path):
    """Six tiny-vit variants that share nothing, on disk: name -> path."""
    paths = {}
    for i in range(6):
        path = tmp_path / f"vit{i}.onnx"
        onnx.save(zoo.build("tiny-vit", seed=100 + i), str(path))
        paths[f"vit{i}"] = str(path)
    return paths


def start(tmp_path, **settings) -> DaemonProcess:
    env = {f"MODELCACHE_{k.upper()}": str(v) for k, v in settings.items()}
    return DaemonProcess(tmp_path, env).start()


def stop(d: DaemonProcess) -> None:
    assert d.stop() == 0, d.log_path.read_text()[-3000:]
    d.kill()


def test_oversubscribed_working_set_never_fails_and_never_overflows(tmp_path, vits):
    capacity = int(3.5 * SEGMENT_BYTES)            # the working set is 6 models: ~1.7x capacity
    d = start(tmp_path, host_capacity=capacity, eviction_policy="lru")
    try:
        feeds = zoo.sample_inputs(next(iter(vits.values())))
        refs = {n: ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
                for n, p in vits.items()}
        np.savez(tmp_path / "refs.npz", **refs)
        np.savez(tmp_path / "refs-feeds.npz", **feeds)
        with d.client() as c:
            for n, p in vits.items():
                c.add(p, n)
            env = {**os.environ, "MODELCACHE_SOCKET": d.socket}
            workers = [subprocess.Popen([sys.executable, str(HERE / "client_worker.py"), "churn",
                                         str(tmp_path / "refs.npz"), "8", str(seed)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                       for seed in range(3)]
            peak = 0
            while any(w.poll() is None for w in workers):
                host = c.stats().tiers[0]
                peak = max(peak, host["used_bytes"])
                assert host["used_bytes"] <= capacity
            results = [json.loads(w.stdout.read().strip().splitlines()[-1]) for w in workers]
            st = c.stats()
        for r in results:
            assert r["other_errors"] == [] and r["wrong"] == 0 and r["capacity_errors"] == 0
        assert sum(r["runs"] for r in results) > 30
        assert st.counters["evictions"] > 0 and peak > 2 * SEGMENT_BYTES
    finally:
        stop(d)


def test_full_of_pinned_models_is_a_clear_capacity_error(tmp_path, vits):
    """open_when_full = wait: the open waits for room (with disk, the default, it maps the repository's files:
    test_disk_opens.py)."""
    d = start(tmp_path, host_capacity="1M", open_when_full="wait")   # three of them (the least a tier may be)
    try:
        with d.client(timeout_s=5) as c:                 # (0.5 s between the daemon's answer and the client's end)
            for n in ("vit0", "vit1", "vit2", "vit3"):
                c.add(vits[n], n)
            for n in ("vit0", "vit1", "vit2"):
                c.load(n)
            c.pin("vit0")
            c.pin("vit2")
            s1 = modelcache.InferenceSession("vit1", client=c)     # in use: not a victim either
            # The open waits for room until just before the client gives up (its timeout), then says why.
            with pytest.raises(CapacityError, match=r"^waited 4\.5 s for room, until the request's deadline: vit3@1 "
                                                    r".*the models there cannot be evicted now: vit0@1 \(pinned\), "
                                                    r"vit1@1 \(in use by 1 session\), vit2@1 \(pinned\); unpin, close "
                                                    r"sessions, or raise host_capacity$"):
                c.open("vit3")
            models = {m["name"]: m for m in c.list()}
            assert models["vit0"]["tier"] == "host" and models["vit1"]["tier"] == "host"  # nothing disturbed
            assert models["vit3"]["tier"] == "disk" and models["vit3"]["state"] == "on_disk"
            s1.close()
            with modelcache.InferenceSession("vit3", client=c):       # vit1 is now free to go
                pass
            models = {m["name"]: m for m in c.list()}
            assert models["vit1"]["tier"] == "disk" and models["vit0"]["pinned"]
            c.pin("vit0", pinned=False)
            with pytest.raises(CapacityError, match="in use"):
                with modelcache.InferenceSession("vit0", client=c):
                    c.evict("vit0")
    finally:
        stop(d)


def test_model_bigger_than_the_tier_is_refused(tmp_path, vits):
    """open_when_full = wait (with disk it is served from the repository's files: test_disk_opens.py)."""
    d = start(tmp_path, host_capacity="1M", open_when_full="wait")   # the least a tier may be; squeezenet ~4.7 MiB
    big = tmp_path / "big.onnx"
    onnx.save(zoo.build("squeezenet1_1"), str(big))
    try:
        with d.client() as c:
            c.add(str(big), "big")
            t0 = time.monotonic()
            with pytest.raises(CapacityError, match=r"^big@1 needs [\d.]+ [KM]iB in the host tier, more than the whole "
                                                    r"tier \(host_capacity = [\d.]+ [KM]iB\): the model alone does not "
                                                    r"fit; raise host_capacity$"):
                modelcache.InferenceSession("big", client=c)
            assert time.monotonic() - t0 < 5        # at once: it does not wait for room that cannot come
            assert c.stats().tiers[0]["used_bytes"] == 0
    finally:
        stop(d)


def test_models_sharing_most_tensors_cost_barely_more_than_one(tmp_path):
    d = start(tmp_path)
    try:
        a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
        onnx.save(variant(0), str(a))
        onnx.save(variant(1, change_last=2), str(b))   # b: a "fine-tuned" a: its last two tensors differ
        with d.client() as c:
            c.add(str(a), "base")
            c.add(str(b), "finetuned")
            from modelcache.store.format import load_manifest
            ma, mb = (load_manifest(d.repository / n / "1") for n in ("base", "finetuned"))
            shared = sum(t.nbytes for t in mb.tensors if t.sha256 in {x.sha256 for x in ma.tensors})
            cpu_bytes = sum(t.nbytes for t in mb.tensors)   # (the blob also holds the GPU variant)
            assert 0.85 <= shared / cpu_bytes <= 0.90   # the case: ~90 % of the bytes shared
            c.load("base")
            one = c.stats().tiers[0]["used_bytes"]
            shm_one = sum(f.stat().st_blocks * 512 for f in d.shm_dir.glob("seg-*"))
            c.load("finetuned")
            both = c.stats().tiers[0]["used_bytes"]
            shm_both = sum(f.stat().st_blocks * 512 for f in d.shm_dir.glob("seg-*"))
            assert both <= 1.15 * one and shm_both <= 1.15 * shm_one
            feeds = zoo.sample_inputs(str(a))
            for name, src in (("base", a), ("finetuned", b)):
                want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
                with modelcache.InferenceSession(name, client=c) as s:
                    np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
    finally:
        stop(d)


def test_eager_policy_frees_on_last_close(tmp_path, vits):
    d = start(tmp_path, eviction_policy="eager")
    try:
        with d.client() as c:
            c.add(vits["vit0"], "vit0")
            s1 = modelcache.InferenceSession("vit0", client=c)
            s2 = modelcache.InferenceSession("vit0", client=c)
            s1.close()
            assert c.list()[0]["tier"] == "host"
            s2.close()
            assert c.list()[0]["tier"] == "disk" and c.stats().tiers[0]["used_bytes"] == 0
    finally:
        stop(d)


@pytest.fixture
def http_store(tmp_path, vits):
    """A remote store: packed models + index.json, served by http.server on a loopback ephemeral port."""
    store = tmp_path / "store"
    from modelcache.store.packing import pack
    for n in ("vit0", "vit1"):
        pack(vits[n], store, n, 1)
    subprocess.run([sys.executable, "-m", "modelcache.cli", "publish", str(store)], check=True, capture_output=True)
    handler = functools.partial(QuietHandler, directory=str(store))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield store, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_remote_store_fetch_on_first_open(tmp_path, vits, http_store):
    store, url = http_store
    (tmp_path / "node").mkdir()
    d = start(tmp_path / "node", remote=url)
    try:
        with d.client() as c:
            assert c.list() == []
            # Several clients open the remote-only model at once: one fetch, everyone served.
            clients = [d.client() for _ in range(4)]
            out = []
            threads = [threading.Thread(target=lambda cl=cl: out.append(cl.open("vit0"))) for cl in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(out) == 4
            log = d.log_path.read_text()
            assert log.count("model fetched: vit0@1") == 1
            assert [(m["name"], m["tier"]) for m in c.list()] == [("vit0", "host")]
            assert (d.repository / "vit0" / "1" / "weights.bin").exists()
            for cl in clients:
                cl.close()
            feeds = zoo.sample_inputs(vits["vit0"])
            want = ort.InferenceSession(vits["vit0"], providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            with modelcache.InferenceSession("vit0", client=c) as s:
                np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
            with pytest.raises(ModelNotFound, match="remote store"):
                c.open("nothing-anywhere")
            # A corrupted file on the server: refused, nothing half-fetched becomes visible.
            with open(store / "vit1" / "1" / "weights.bin", "r+b") as f:
                f.seek(100)
                f.write(b"\xff\xff\xff\xff")
            with pytest.raises(RemoteError, match="does not match its index"):
                c.load("vit1")
            assert [m["name"] for m in c.list()] == ["vit0"]
            assert not (d.repository / "vit1").exists() and not list(d.repository.glob(".tmp-*"))
    finally:
        stop(d)


def test_unreachable_remote_store_is_a_clear_error(tmp_path, vits):
    d = start(tmp_path, remote="http://127.0.0.1:9/")   # discard port: nothing listens
    try:
        with d.client() as c:
            with pytest.raises(RemoteError, match="cannot read"):
                c.open("vit0")
            c.add(vits["vit0"], "local")
            with modelcache.InferenceSession("local", client=c):   # local models are unaffected
                pass
    finally:
        stop(d)


def test_cli_load_pin_unpin_rm(tmp_path, vits):
    d = start(tmp_path)
    try:
        def cli(*args):
            r = subprocess.run([sys.executable, "-m", "modelcache.cli", *args], env=d.env, capture_output=True,
                               text=True)
            assert r.returncode == 0, r.stderr
            return r.stdout
        with d.client() as c:
            c.add(vits["vit0"], "vit0")
            assert cli("load", "vit0").startswith("loaded vit0@1 into the host tier in ")
            assert c.list()[0]["tier"] == "host"
            cli("pin", "vit0")
            row = next(line for line in cli("ls").splitlines() if line.startswith("vit0"))
            assert "yes" in row and "host" in row
            cli("unpin", "vit0")
            assert not c.list()[0]["pinned"]
            cli("rm", "vit0", "--version", "1")
            assert c.list() == [] and not (d.repository / "vit0" / "1").exists()
    finally:
        stop(d)
