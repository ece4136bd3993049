"""The benchmark commands keep working (on tiny models; the figures themselves come from full runs)."""

import csv
import json
import subprocess
import sys

import pytest

from modelcache.bench.coldstart import MODES


def run(*args, timeout=600):
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "bench", *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_coldstart_quick_on_tiny_models(tmp_path):
    out = tmp_path / "coldstart"
    text = run("coldstart", "--quick", "--models", "tiny-cnn", "tiny-vit", "--runs", "2", "--clients", "1", "2",
               "--out", str(out))
    measured = MODES
    latency_table = text.split("\n\n")[0]
    for model in ("tiny-cnn", "tiny-vit"):
        rows = [line.split() for line in latency_table.splitlines() if line.startswith(model + " ")]
        assert [r[1] for r in rows if r[1] in MODES] == measured
    samples = list(csv.DictReader(open(out / "samples.csv")))
    assert len(samples) == 2 * 2 * len(measured)
    assert all(float(s["total_ms"]) > 0 for s in samples)
    results = json.loads((out / "results.json").read_text())
    assert {(r["mode"], r["clients"]) for r in results["memory"]} == {(m, k) for m in ("ort", "ort-mmap", "attach-hit")
                                                                       for k in (1, 2)}
    assert (out / "speedup.png").stat().st_size > 1000 and (out / "memory.png").stat().st_size > 1000


@pytest.mark.slow
def test_open_bench_on_a_tiny_model(tmp_path):
    text = run("open", "--models", "tiny-cnn", "--runs", "1", "--warm-runs", "3", "--out", str(tmp_path))
    assert "tiny-cnn" in text and "vs plain ORT: session ready" in text and "vs ORT's mmap of .ort" in text
    assert {s["mode"] for s in json.loads((tmp_path / "results.json").read_text())["samples"]} == \
        {"ort", "ort-mmap", "modelcache"}
    assert json.loads((tmp_path / "results.json").read_text())["samples"]


def test_tiers_bench_on_tiny_models(tmp_path):
    text = run("tiers", "--model", "tiny-cnn", "--big", "tiny-vit", "--runs", "2", "--out", str(tmp_path))
    for path in ("host hit", "disk miss", "remote miss"):
        assert path in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["open_ms"]["remote miss"]) == 2 and all(v > 0 for v in results["promote_mb_s"])


@pytest.mark.slow
def test_executor_bench_runs(tmp_path):
    text = run("executor", "--model", "tiny-vit", "--seconds", "1", "--clients", "2", "--calls", "20",
               "--out", str(tmp_path))
    assert "overhead" in text and "where it goes" in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["workers"], r["scheduler"]) for r in results["throughput"]][:4] == \
        [("2", "eager"), ("2", "dmda"), ("1,1", "eager"), ("1,1", "dmda")]   # then "2+gpu" where a GPU is
    assert all(r["requests"] > 0 for r in results["throughput"])


@pytest.mark.slow
def test_serve_bench_quick_sweeps_bisects_and_writes_csv_and_plots(tmp_path):
    out = tmp_path / "serve"
    text = run("serve", "--quick", "--policies", "serial", "layer", "--work", str(tmp_path / "work"),
               "--out", str(out))
    assert "max sustainable rate (p99 <= t_opt): serial" in text
    rows = list(csv.DictReader(open(out / "serve.csv")))
    assert {(r["policy"], r["phase"]) for r in rows} == {(p, ph) for p in ("serial", "layer")
                                                         for ph in ("sweep", "bisect")}
    sweep = [r for r in rows if r["phase"] == "sweep"]
    assert all(int(r["sent"]) > 0 for r in sweep)
    light = [r for r in sweep if float(r["rate_rps"]) == min(float(x["rate_rps"]) for x in sweep)]
    assert all(int(r["completed"]) == int(r["sent"]) for r in light)   # light load: everything answered
    results = json.loads((out / "results.json").read_text())
    assert results["models"]["tiny-cnn"]["profile"]["n_opt"] >= 1
    for png in ("tiny-cnn-latency.png", "tiny-cnn-bars.png"):
        assert (out / png).stat().st_size > 1000


@pytest.mark.slow
def test_soak_reports_each_interval_and_the_slopes(tmp_path):
    text = run("soak", "--minutes", "0.15", "--report-s", "3", "--clients", "3",
               "--models", "tiny-cnn", "tiny-fp16", "tiny-embed", "--out", str(tmp_path))
    assert "slopes per minute: RSS" in text and "daemon crashed: no" in text
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["host_capacity_bytes"] < r["weights_bytes"]            # the tier cannot hold all three
    assert len(r["minutes"]) >= 2 and r["totals"]["requests"] > 50
    assert r["totals"]["wrong"] == 0 and r["totals"]["unexplained_errors"] == 0 and r["totals"]["dropped"] == 0
    assert all(m["rss_mib"] > 0 and m["fds"] > 0 for m in r["minutes"])
    assert sum(m["evictions"] for m in r["minutes"]) > 0        # models were evicted under the others' load
    assert set(r["slopes_per_minute"]) == {"rss_mib", "fds", "shm_mib"}
    assert r["client_exit_codes"] == [0, 0, 0]


def test_fuzz_command_counts_and_bounds(tmp_path):
    """A short run of the long fuzz: the named cases of issue 15 included; it exits 0 only if it held."""
    text = run("fuzz", "--messages", "400", "--batch", "100", "--out", str(tmp_path))
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["crashes"] == 0 and r["hangs"] == 0 and r["internal_errors"] == 0, text
    assert r["counts"]["sent_zmq"] + r["counts"]["sent_lane"] >= 400 and r["largest_message_mib"] > 45
    assert "peak RSS" in text and "RSS after" in text


def test_coldstart_cuda_without_a_gpu_says_what_is_missing():
    from modelcache.bench.coldstart_cuda import NoCudaDevice, preflight
    try:
        preflight()
    except NoCudaDevice:
        pass
    else:
        pytest.skip("this machine has a CUDA device with onnxruntime-gpu and cupy: the GPU form runs here")
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "bench", "coldstart", "--device", "cuda", "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "bench coldstart --device cuda needs a CUDA device" in r.stderr and "modelcache[gpu]" in r.stderr


def test_coldstart_cuda_host_attach_layout_is_the_host_tiers_gpu_variant(tmp_path, monkeypatch, zoo_file):
    """host-attach maps the GPU variant where the host tier holds it: checked here on CPU ORT (fake GPU tier)."""
    import numpy as np
    import onnxruntime as ort
    from conftest import DaemonProcess, stop_cleanly
    from modelcache import zoo
    from modelcache.bench.coldstart_cuda import write_layouts
    from modelcache.session_options import attach_session_options, bind_weights

    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    d = DaemonProcess(tmp_path, {"MODELCACHE_FAKE_GPUS": "1x64M"}).start()
    try:
        src = zoo_file("tiny-vit")
        with d.client() as c:
            c.add(src, "vit")
            c.load("vit", tier="gpu")
            [path] = write_layouts(c, ["vit"], d.repository, tmp_path).values()
            layout = json.loads(open(path).read())
            lease = c.open("vit")
            so = attach_session_options()
            maps, values = bind_weights(so, layout["segments"], layout["tensors"])
            sess = ort.InferenceSession(layout["skeleton"], so, providers=["CPUExecutionProvider"])
            feeds = zoo.sample_inputs(src)
            want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
            np.testing.assert_allclose(sess.run(None, feeds)[0], want[0], rtol=1e-4, atol=1e-5)
            assert layout["skeleton"].endswith(".gpu.onnx") and layout["bytes"] > 0
            del sess, values, maps
            c.release(lease.lease_id)
    finally:
        stop_cleanly(d)


def test_coldstart_cuda_report_and_plots_from_recorded_samples(tmp_path):
    """The GPU run is rare: its report and plots are checked here on samples shaped as the children print them."""
    from modelcache.bench.coldstart_cuda import MODES, plot, report
    samples = [{"mode": m, "model": n, "ready_ms": r + i, "first_ms": f + i, "interpreter_ms": 60.0,
                "imports_ms": 300.0, "session_ms": 50.0, "first_run_ms": 300.0, "run": i}
               for n in ("vgg16", "resnet50") for i in range(3)
               for m, r, f in zip(MODES, (1900, 900, 545, 560, 300, 540), (2120, 1200, 840, 870, 310, 630))]
    memory = [{"model": "vgg16", "mode": "arena", "clients": 0, "device_mib": 530.0, "weights_mib": 528.0},
              {"model": "vgg16", "mode": "floor", "clients": 1, "device_mib": 520.0, "per_client_mib": 520.0,
               "weights_mib": 528.0}] + \
             [{"model": "vgg16", "mode": m, "clients": k, "device_mib": k * per, "per_client_mib": per,
               "weights_mib": 528.0} for k in (1, 2, 4, 8) for m, per in (("ort-cuda", 1500.0), ("gpu-attach-hit", 732.0))]
    data = {"device": "NVIDIA H100 (fake figures)", "samples": samples, "memory": memory,
            "promotion": [{"model": "vgg16", "bytes": 528 << 20, "load_gb_s": 40.0, "copy_gb_s": 50.0}],
            "bandwidth": {"bytes": 528 << 20, "pageable_gb_s": 7.3, "pinned_gb_s": 54.7}}
    import io
    out = io.StringIO()
    report(data, out)
    text = out.getvalue()
    assert "gpu-attach-hit ready at 1.01x ideal's ready" in text
    assert "serve first result 6.82x faster than ort-cuda" in text
    assert "0.91x pinned" in text and "4 gpu-attach clients + the daemon's arena: 3458 MiB" in text
    assert sorted(plot(data, tmp_path)) == ["memory-cuda.png", "speedup-cuda.png"]


def test_coldstart_cuda_steps_that_need_no_cuda_run_against_a_fake_gpu_daemon(tmp_path, monkeypatch, zoo_file):
    """Serve warm-up, demotion once the GPU worker lets go, promotion figures and the serve sample: the
    parent's steps around the CUDA children, on a daemon with a simulated GPU and the bench's settings."""
    from conftest import DaemonProcess, stop_cleanly
    from modelcache.bench.coldstart_cuda import (DAEMON_ENV, demote, measure_latency, measure_promotion,
                                                 model_row, warm_serve, write_layouts)
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "1x64M")
    d = DaemonProcess(tmp_path, {"MODELCACHE_FAKE_GPUS": "1x64M", "MODELCACHE_WORKERS": "1", **DAEMON_ENV}).start()
    lines = []
    try:
        src = zoo_file("tiny-cnn")
        with d.client() as c:
            c.add(src, "cnn")
            c.load("cnn", tier="gpu")
            layouts = write_layouts(c, ["cnn"], d.repository, tmp_path)
            kinds = warm_serve(c, "cnn", src, lines.append)
            assert kinds and "calibrated" in lines[-1]
            demote(c, "cnn", timeout_s=60)          # waits for the GPU worker's idle sessions to go
            assert model_row(c, "cnn")["gpu"] == []
            [row] = measure_promotion(c, ["cnn"], layouts, 1, lines.append)
            assert row["copy_gb_s"] > 0 and row["load_gb_s"] > 0
            samples = measure_latency(c, d.socket, {"cnn": src}, layouts, "-", ["serve"], 1, lines.append)
            assert [s["mode"] for s in samples] == ["serve"] and 0 < samples[0]["ready_ms"] < samples[0]["first_ms"]
    finally:
        stop_cleanly(d)


@pytest.mark.slow
def test_http_bench_compares_the_v2_front_with_the_lane(tmp_path):
    text = run("http", "--model", "tiny-cnn", "--big", "tiny-vit", "--calls", "20", "--big-calls", "4",
               "--seconds", "1", "--clients", "2", "--out", str(tmp_path))
    assert "http-binary" in text and "added" in text and "Triton" in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["latency"]) == {"tiny-cnn", "tiny-vit"}
    assert all(len(v) >= 20 for v in results["latency"]["tiny-cnn"].values())
    tp = results["throughput"]["tiny-cnn"]
    assert tp["lane"]["requests"] > 0 and tp["http-binary"]["requests"] > 0
    assert set(tp["http-binary"]["cpu_us_per_request"]) == {"front", "daemon"}


@pytest.mark.parametrize("modes", [["ort", "attach-hit", "serve", "ideal"], ["attach-hit", "serve"], ["serve"]])
def test_coldstart_report_and_plot_any_subset_of_modes(tmp_path, modes):
    """`--modes ort attach-hit serve ideal` ran the whole benchmark, then failed on KeyError: 'ort-tuned'."""
    import io

    from modelcache.bench.coldstart import plot, report
    samples = [{"model": "m", "mode": mode, "run": r, "total_ms": 10.0 + r + i, "interpreter_ms": 1.0,
                "imports_ms": 2.0, "session_ms": 3.0, "first_run_ms": 4.0}
               for r in range(3) for i, mode in enumerate(modes)]
    out = io.StringIO()
    report(samples, [], out)
    text = out.getvalue()
    assert all(f"m              {mode:<12}" in text for mode in modes)
    assert ("faster than ort" in text) == ("ort" in modes and "attach-hit" in modes)
    plot(samples, [], tmp_path)
