"""Running as a service: systemd notify + watchdog, reload, metrics, status, graceful and immediate stop."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

import modelcache
from modelcache import zoo
from conftest import DaemonProcess, stop_cleanly, wait_until

REPO = Path(__file__).resolve().parent.parent


class FakeSystemd:
    """A NOTIFY_SOCKET to listen on, as systemd would."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(20)

    def expect(self, key: str, max_messages: int = 200) -> dict:
        for _ in range(max_messages):
            fields = dict(line.split("=", 1) for line in self.sock.recv(4096).decode().splitlines())
            if key in fields:
                return fields
        raise AssertionError(f"no {key} from the daemon")

    def close(self):
        self.sock.close()


def test_notify_ready_watchdog_reload_stopping(tmp_path):
    fake = FakeSystemd(tmp_path / "notify")
    d = DaemonProcess(tmp_path, {"NOTIFY_SOCKET": str(fake.path), "WATCHDOG_USEC": "400000"})
    try:
        d.start()
        ready = fake.expect("READY")
        assert ready["READY"] == "1" and ready["MAINPID"] == str(d.pid) and "models" in ready["STATUS"]
        fake.expect("WATCHDOG")
        fake.expect("WATCHDOG")  # keeps coming while the loop turns
        d.proc.send_signal(signal.SIGHUP)
        assert "MONOTONIC_USEC" in fake.expect("RELOADING")
        fake.expect("READY")
        d.proc.send_signal(signal.SIGTERM)
        fake.expect("STOPPING")
        assert d.proc.wait(30) == 0
    finally:
        d.kill()
        fake.close()


def test_reload_applies_live_settings(tmp_path):
    conf = tmp_path / "modelcache.toml"
    conf.write_text("lease_timeout_s = 4.0\n")
    d = DaemonProcess(tmp_path, {"MODELCACHE_CONFIG": str(conf)}).start()
    try:
        conf.write_text("lease_timeout_s = 1.5\nlog_level = \"debug\"\neviction_policy = \"lfu\"\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reloaded settings: lease_timeout_s applied" in d.log_path.read_text(), what="reload")
        log = d.log_path.read_text()
        assert "reload: lease_timeout_s 4.0 -> 1.5" in log                     # every change is said, old -> new
        assert "reload: eviction_policy 'lru' -> 'lfu' needs a restart of the daemon; keeping 'lru'" in log
        conf.write_text("lease_timeout_s = 'soon'\n")  # a bad file: keep the old settings, stay up
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload failed, keeping the old settings" in d.log_path.read_text(), what="bad reload")
        with d.client() as c:
            assert c.list() == []
    finally:
        assert d.stop() == 0
        d.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_prometheus(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_scrape(tmp_path, zoo_file):
    port = free_port()
    d = DaemonProcess(tmp_path, {"MODELCACHE_METRICS_PORT": str(port)}).start()
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
            s1 = modelcache.InferenceSession("cnn", client=c)
            s2 = modelcache.InferenceSession("cnn", client=c)

            def scrape():
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                    return parse_prometheus(r.read().decode())

            m = wait_until(lambda: (lambda m: m if m.get("modelcache_opens_total") == 2 else None)(scrape()),
                           what="a snapshot with both opens")
            # (the blob also holds the GPU variant, which a daemon without GPUs does not promote)
            host_bytes = next(t for t in c.stats().tiers if t["tier"] == "host")["used_bytes"]
            assert m["modelcache_hits_total"] == 1 and m["modelcache_misses_total"] == 1
            assert m['modelcache_tier_used_bytes{tier="host"}'] == host_bytes > 0
            assert m['modelcache_models{state="resident"}'] == 1
            assert m['modelcache_model_refcount{model="cnn",version="1"}'] == 2
            assert m["modelcache_open_latency_seconds_count"] == 2
            assert m['modelcache_open_latency_seconds_bucket{le="+Inf"}'] == 2
            assert m["modelcache_clients"] >= 1
            c.infer("cnn", zoo.sample_inputs(zoo_file("tiny-cnn")))
            m = wait_until(lambda: (lambda m: m if m.get('modelcache_inference_requests_total{result="ok"}') == 1
                                    else None)(scrape()), what="a snapshot with the inference")
            # labelled as every other per-model metric: model and version apart
            assert m['modelcache_inference_latency_seconds_count{model="cnn",version="1"}'] == 1
            assert m['modelcache_model_resident_bytes{model="cnn",version="1"}'] == host_bytes
            assert any(k.startswith("modelcache_worker_queue_length{worker=") for k in m)
            assert m['modelcache_inference_refused_total{reason="queue_full"}'] == 0   # (no max_queue: none)
            assert m['modelcache_inference_refused_total{reason="queue_timeout"}'] == 0
            assert m["modelcache_outputs_lent_total"] == m["modelcache_outputs_large_inline_total"] == 0   # (small)
            s1.close()
            s2.close()
    finally:
        assert d.stop() == 0
        d.kill()


def test_status_is_one_readable_screen(daemon, client, zoo_file):
    client.add(zoo_file("tiny-cnn"), "cnn")
    client.infer("cnn", zoo.sample_inputs(zoo_file("tiny-cnn")))
    with modelcache.InferenceSession("cnn", client=client):
        r = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=daemon.env,
                           capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"modelcache {modelcache.__version__}  pid {daemon.pid}  up ")
    assert any(line.startswith("host ") and str(daemon.shm_dir) in line for line in lines)
    row = next(line for line in lines if line.startswith("cnn "))
    assert row.split()[:2] == ["cnn", "1"] and "host" in row and "resident" in row
    clients = next(line for line in lines if re.fullmatch(r"\d+ clients?", line))
    assert clients in ("1 client", *(f"{n} clients" for n in range(2, 9))), clients    # counts read right
    serve = next(line for line in lines if line.startswith("serve: "))
    assert serve.startswith("serve: 1 served, 0 failed") and " over cpu" in serve   # the worker kinds
    assert any(line.startswith("batching: *=serial; 1 batch, mean 1.00 requests, 0 layer joins") for line in lines), \
        lines
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "stats"], env=daemon.env, capture_output=True,
                       text=True)
    stats = json.loads(r.stdout)
    assert "req_id" not in stats and stats["pid"] == daemon.pid       # the wire's id is not the daemon's state


def test_status_names_the_http_fronts_client(tmp_path, zoo_file):
    """The HTTP front's lane connection is a client of the daemon: `status` names it, not a blank."""
    pytest.importorskip("httptools")
    from test_http import HttpFront
    d = DaemonProcess(tmp_path).start()
    front = None
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
            front = HttpFront(d)
            status, _, _ = front.request("POST", "/v2/models/cnn/infer", body=json.dumps(
                {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [0.5] * 3072}]}))
            assert status == 200
            names = [cl["name"] for cl in c.stats().clients]
        assert "http-front" in names and "" not in names, names
    finally:
        rc = front.stop() if front is not None else 0
        stop_cleanly(d)
        assert rc == 0


def test_publish_refuses_a_folder_that_is_not_a_repository(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "publish", str(tmp_path)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and r.stdout == "" and r.stderr.startswith(f"modelcache: {tmp_path} is not a repository")
    assert not (tmp_path / "index.json").exists()


def test_graceful_stop_finishes_inflight_work_and_keeps_mappings(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    src = zoo_file("resnet50")
    c = d.client()
    c.add(zoo_file("tiny-cnn"), "cnn")
    sess = modelcache.InferenceSession("cnn", client=c)
    result = {}

    def add():
        try:
            with d.client() as c2:
                result["reply"] = c2.add(src, "r50")
        except Exception as e:  # pragma: no cover - asserted below
            result["error"] = e

    t = threading.Thread(target=add)
    t.start()
    wait_until(lambda: any(j["kind"] == "add" for j in c.stats().jobs), what="the add to start")
    d.proc.send_signal(signal.SIGTERM)
    t.join(120)
    assert d.proc.wait(60) == 0
    assert "reply" in result, result.get("error")  # the running pack finished and was answered
    assert not d.shm_dir.exists() and not Path(d.socket[6:]).exists()
    # A session built before the stop still runs: its mapping outlived the daemon's files.
    assert sess.run(None, zoo.sample_inputs(zoo_file("tiny-cnn")))[0].shape == (1, 10)
    sess.close()
    c.close()
    d2 = DaemonProcess(tmp_path).start()
    try:
        with d2.client() as c3:
            assert sorted(m["name"] for m in c3.list()) == ["cnn", "r50"]
    finally:
        assert d2.stop() == 0
        d2.kill()


def test_second_signal_stops_at_once(tmp_path, zoo_file):
    d = DaemonProcess(tmp_path).start()
    src = zoo_file("alexnet")   # 233 MiB: its add takes seconds (~8 s here), the stop a fraction of one
    adder = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "add", src, "--name", "big",
                              "--require-daemon"], env=d.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        with d.client() as c:
            wait_until(lambda: any(j["kind"] == "add" for j in c.stats().jobs), what="the add to start")
        d.proc.send_signal(signal.SIGTERM)
        # Two signals sent back to back could coalesce into one: send the second once the first took hold.
        wait_until(lambda: "stopping:" in d.log_path.read_text(), what="the graceful stop to begin")
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(10) == 1  # did not wait for the pack of AlexNet
        assert not d.shm_dir.exists() and not Path(d.socket[6:]).exists()
        assert adder.wait(60) == 1
        assert b"modelcache:" in adder.stderr.read()  # a typed error, not a traceback or a hang
    finally:
        adder.kill()
        d.kill()


def test_journald_lines_have_no_timestamp():
    code = ("import logging; from modelcache.cli import _setup_logging; _setup_logging('info'); "
            "logging.getLogger('modelcache.x').info('model added')")
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}).stderr
    journal = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "JOURNAL_STREAM": "8:1234"}).stderr
    assert journal.strip() == "INFO modelcache.x: model added"
    assert plain.strip().endswith("INFO modelcache.x: model added") and plain[:4].isdigit()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path):
    exe = shutil.which("modelcache") or str(Path(sys.executable).parent / "modelcache")
    if not os.access(exe, os.X_OK):
        pytest.skip("the modelcache console script is not installed")
    unit = (REPO / "systemd" / "modelcache.service").read_text().replace("/usr/local/bin/modelcache", exe)
    path = tmp_path / "modelcache.service"
    path.write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
