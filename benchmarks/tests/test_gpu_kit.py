"""benchmarks/gpu: the kit a GPU session carries (split, staged call by call, reassembled, checked by sha256), the
report and its figures against issue #30's targets, and verify.sh's steps that need no GPU. Small fake files and
a small budget: nothing is downloaded. Run from the repository root:
PYTHONPATH=. python -m pytest -q benchmarks/tests/test_gpu_kit.py"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu import chunks, prepare, report, targets
from benchmarks.gpu.chunks import KitError

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"


@pytest.fixture
def files(tmp_path):
    """A 'wheel' too big for one call, and two small ones, with bytes that differ at every offset."""
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"big-1.0-cp312-manylinux_2_28_x86_64.whl": 10_000, "small-2.0-py3-none-any.whl": 1_500,
             "tiny-3.0-py3-none-any.whl": 7}
    out = []
    for i, (name, size) in enumerate(sizes.items()):
        (src / name).write_bytes(os.urandom(size))
        out.append(src / name)
    return out


def carry_one_call_at_a_time(kit: Path, state: Path, calls) -> list[dict]:
    """What the device sees: each call's working tree holds only the folder that call carried."""
    progress = []
    for n in calls:
        there = state.parent / f"tree-call{n}" / ".gpukit"
        shutil.copytree(kit / f"call{n}", there / f"call{n}")
        progress.append(chunks.stage(there, state))
    return progress


# -- the kit ----------------------------------------------------------------------------------------

def test_split_fits_each_call_and_reassembles_byte_identical(files, tmp_path):
    kit, state = tmp_path / ".gpukit", tmp_path / "state"
    manifest = chunks.split(files, kit, budget=4_000)
    assert manifest["calls"] == 3          # 11.5 kB end to end in three calls of 3836 bytes
    for n in range(1, 4):
        parts = [p for p in (kit / f"call{n}").iterdir() if p.name != chunks.MANIFEST]
        assert sum(p.stat().st_size for p in parts) <= 4_000
        assert json.loads((kit / f"call{n}" / chunks.MANIFEST).read_text()) == manifest
    big = manifest["files"][files[0].name]
    assert [(p["call"], p["size"]) for p in big["parts"]] == [(1, 3_836), (2, 3_836), (3, 2_328)]
    assert [len(manifest["files"][f.name]["parts"]) for f in files[1:]] == [1, 1]   # room for both in call 3
    assert big["sha256"] == chunks.sha256_file(files[0])

    progress = carry_one_call_at_a_time(kit, state, [1, 2, 3])
    assert [p["missing"] for p in progress] == [[2, 3], [3], []]
    rebuilt = chunks.assemble(state, tmp_path / "wheels")
    assert sorted(p.name for p in rebuilt) == sorted(f.name for f in files)
    for f in files:
        assert (tmp_path / "wheels" / f.name).read_bytes() == f.read_bytes()


@pytest.mark.parametrize("sizes, budget", [({"a": 10, "b": 10, "c": 10}, 10), ({"a": 1, "b": 0, "c": 99}, 7),
                                           ({"w": 255_569_273, "z": 855_178}, 61_236_838)])
def test_the_plan_takes_the_fewest_calls_and_covers_every_byte_once(sizes, budget):
    calls = chunks.plan(sizes, budget)
    assert len(calls) == -(-sum(sizes.values()) // budget)
    assert all(sum(p[3] for p in call) <= budget for call in calls)
    for name, size in sizes.items():
        cut = sorted((p[2], p[3]) for call in calls for p in call if p[0] == name)
        assert cut[0][0] == 0 and sum(length for _, length in cut) == size
        assert all(a + la == b for (a, la), (b, _) in zip(cut, cut[1:]))   # contiguous, no overlap


def test_a_file_that_fits_travels_whole(files, tmp_path):
    manifest = chunks.split(files, tmp_path / ".gpukit", budget=20_000)
    assert manifest["calls"] == 1
    assert all(len(e["parts"]) == 1 and e["parts"][0]["name"] == name for name, e in manifest["files"].items())


def test_a_corrupted_part_is_caught_when_it_arrives(files, tmp_path):
    kit = tmp_path / ".gpukit"
    manifest = chunks.split(files, kit, budget=4_000)
    part = next(p for p in manifest["files"][files[0].name]["parts"] if p["call"] == 2)
    path = kit / "call2" / part["name"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(KitError, match=rf"carried part .*{part['name']}: sha256 .* the manifest says .*corrupt"):
        chunks.stage(kit, tmp_path / "state")
    # the command verify.sh runs says it in one line and fails
    r = subprocess.run([sys.executable, str(GPU / "chunks.py"), "stage", str(kit), str(tmp_path / "state")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.startswith("gpukit: carried part") and "corrupt" in r.stderr and r.stderr.count("\n") == 1


def test_a_cut_short_part_is_named_with_its_size(files, tmp_path):
    kit = tmp_path / ".gpukit"
    manifest = chunks.split(files, kit, budget=4_000)
    part = manifest["files"][files[0].name]["parts"][0]
    path = kit / f"call{part['call']}" / part["name"]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(KitError, match=rf"{part['size'] - 10} bytes, the manifest says {part['size']}: .*cut short"):
        chunks.stage(kit, tmp_path / "state")


def test_a_part_corrupted_after_staging_is_caught_at_assembly(files, tmp_path):
    kit, state = tmp_path / ".gpukit", tmp_path / "state"
    manifest = chunks.split(files, kit, budget=4_000)
    chunks.stage(kit, state)
    staged = state / "parts" / manifest["kit"] / manifest["files"][files[1].name]["parts"][0]["name"]
    staged.write_bytes(b"x" * staged.stat().st_size)
    with pytest.raises(KitError, match=rf"staged part {staged.name}: sha256.*carry it again"):
        chunks.assemble(state, tmp_path / "wheels")
    assert not (tmp_path / "wheels" / files[1].name).exists()
    chunks.stage(kit, state)                  # carried again, as the message says
    chunks.assemble(state, tmp_path / "wheels")
    assert (tmp_path / "wheels" / files[1].name).read_bytes() == files[1].read_bytes()


def test_assembly_names_the_calls_that_never_arrived(files, tmp_path):
    kit, state = tmp_path / ".gpukit", tmp_path / "state"
    chunks.split(files, kit, budget=4_000)
    carry_one_call_at_a_time(kit, state, [1, 3])
    with pytest.raises(KitError, match=r"call\(s\) \[2\] of 3 never arrived"):
        chunks.assemble(state, tmp_path / "wheels")


def test_a_fresh_machine_says_start_again_from_call_1(tmp_path):
    with pytest.raises(KitError, match="this machine is fresh.*from call 1"):
        chunks.assemble(tmp_path / "state", tmp_path / "wheels")


def test_parts_of_two_kits_are_refused(files, tmp_path):
    chunks.split(files[:1], tmp_path / "a", budget=4_000)
    chunks.split(files[1:], tmp_path / "b", budget=4_000)
    kit = tmp_path / ".gpukit"
    shutil.copytree(tmp_path / "a" / "call1", kit / "call1")
    shutil.copytree(tmp_path / "b" / "call1", kit / "call2")
    with pytest.raises(KitError, match="parts of 2 different kits"):
        chunks.stage(kit, tmp_path / "state")


def test_a_new_split_removes_the_old_kits_parts(files, tmp_path):
    kit = tmp_path / ".gpukit"
    chunks.split(files, kit, budget=4_000)
    chunks.split(files[1:], kit, budget=4_000)
    assert sorted(p.name for p in kit.iterdir()) == ["call1"]


def test_no_room_beside_the_working_tree_is_a_clear_error(files, tmp_path):
    with pytest.raises(KitError, match="no room for weights in a call"):
        chunks.split(files, tmp_path / ".gpukit", budget=-5)


# -- prepare.py (its parts that need no download) ---------------------------------------------------

def test_the_run_sequence_carries_one_call_folder_each_and_installs_with_the_last():
    seq = prepare.run_calls(5)
    assert [c for _, c, _ in seq[:5]] == [[f".gpukit/call{n}"] for n in range(1, 6)]
    assert seq[4][0] == "bash benchmarks/gpu/verify.sh stage install probe dropin"
    assert all(cmd == "bash benchmarks/gpu/verify.sh stage" for cmd, _, _ in seq[:4])
    assert [c for _, c, _ in seq[5:]] == [[], []] and all(t <= 600 for _, _, t in seq)
    text = prepare.describe(seq, 5)
    assert "run(command='bash benchmarks/gpu/verify.sh stage', carry=['.gpukit/call1'], timeout_s=120)" in text


def test_prepare_finds_a_wheel_already_there_and_refuses_unpinned_packages(files, tmp_path):
    assert prepare.wheel_for("big==1.0", files[0].parent) == files[0]
    assert prepare.wheel_for("big==1.1", files[0].parent) is None
    assert prepare.fetch(["small==2.0"], files[0].parent) == [files[1]]    # no download: it is there
    with pytest.raises(prepare.KitError, match="pin each package"):
        prepare.fetch(["onnxruntime-gpu"], tmp_path)


def test_what_travels_counts_tracked_and_untracked_files_not_ignored_ones(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.gpukit/\n")
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    (tmp_path / ".gpukit").mkdir()
    (tmp_path / ".gpukit" / "part").write_bytes(b"x" * 10_000)
    assert prepare.travelling_bytes(tmp_path) == 100 + len("/.gpukit/\n")


def test_the_git_ignore_keeps_the_kit_out_of_commits():
    for path in (".gpukit/call1/x.whl.part01of05", ".gpukit-wheels/x.whl"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


# -- the report and its figures ---------------------------------------------------------------------

def samples(model, **modes):
    """Five samples per mode, spread around the given (ready, first) medians."""
    return [{"model": model, "mode": mode, "ready_ms": ready + d, "first_ms": first + d, "run": i}
            for mode, (ready, first) in modes.items() for i, d in enumerate((-20, -10, 0, 10, 20))]


def hand_built_report():
    vgg = {"device": "NVIDIA H200 (abc)",
           "samples": samples("vgg16", **{"ort-cuda": (1900, 2120), "gpu-attach-hit": (560, 840),
                                          "ideal": (540, 630), "serve": (300, 400)}),
           "memory": [{"model": "vgg16", "mode": "arena", "clients": 0, "device_mib": 530, "weights_mib": 528},
                      {"model": "vgg16", "mode": "floor", "clients": 1, "device_mib": 732},
                      {"model": "vgg16", "mode": "gpu-attach-hit", "clients": 4, "device_mib": 4 * 733}],
           "promotion": [{"model": "vgg16", "copy_gb_s": g, "load_gb_s": 1.0, "bytes": 1} for g in (40, 41, 42)],
           "bandwidth": {"bytes": 1, "pageable_gb_s": 7.3, "pinned_gb_s": 54.7}}
    rest = {"device": "NVIDIA H200 (abc)",
            "samples": samples("resnet50", **{"gpu-attach-hit": (600, 1000), "ideal": (540, 630)}),
            "memory": [], "promotion": [{"model": "resnet50", "copy_gb_s": 50.0, "load_gb_s": 1, "bytes": 1}],
            "bandwidth": {"bytes": 1, "pageable_gb_s": 7.0, "pinned_gb_s": 55.0}}
    same = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "bit_identical": True}
    dropin = {"models": {
        "vgg16": {"providers": ["CUDAExecutionProvider"], "vs_ort_cuda": same, "vs_ort_cuda_basic": same},
        "vit_b_16": {"providers": ["CUDAExecutionProvider"],
                     "vs_ort_cuda": {"max_abs_diff": 0.02, "max_rel_diff": 2e-3, "bit_identical": False},
                     "vs_ort_cuda_basic": same}}}
    return {"steps": {"bench-rest": {"status": "timeout", "rc": 124, "seconds": 540, "limit_s": 540}},
            "tests": {"passed": 4, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []},
            "dropin": dropin, "bench": {"vgg16": vgg, "rest": rest}}


def by_figure(rows):
    return {r["figure"]: r for r in rows}


def test_each_target_is_met_or_not_from_a_hand_built_report():
    rows = by_figure(targets.evaluate(hand_built_report()))
    met = lambda f: rows[f]["verdict"]  # noqa: E731
    assert met("gpu-marked tests") == "met"
    assert met("vgg16: gpu-attach-hit spawn->ready / ideal's") == "met"          # 560 / 540 = 1.04
    assert rows["vgg16: gpu-attach-hit spawn->ready / ideal's"]["value"].startswith("1.04x")
    assert met("resnet50: gpu-attach-hit spawn->ready / ideal's") == "NOT met"   # 600 / 540 = 1.11
    assert met("vgg16: gpu-attach-hit spawn->first result, speedup over ort-cuda") == "met"   # 2120 / 840 = 2.52
    assert met("vgg16: serve spawn->first result, speedup over ort-cuda") == "NOT met"        # 2120 / 400 = 5.3
    memory = rows["vgg16: device memory, daemon + 4 gpu-attach clients started together"]
    assert memory["verdict"] == "met" and memory["value"].startswith("3462 MiB vs bound 3482 MiB")
    assert met("vgg16: host->GPU promotion / pinned host->device bandwidth, same run") == "NOT met"   # 41 / 54.7
    assert met("resnet50: host->GPU promotion / pinned host->device bandwidth, same run") == "met"    # 50 / 55
    assert met("vgg16: outputs vs plain ort-cuda") == "met"
    assert met("vit_b_16: outputs vs plain ort-cuda") == "NOT met"
    assert met("vit_b_16: outputs vs plain ort-cuda over the BASIC-optimized graph") == "met"


def test_what_the_report_does_not_hold_is_not_measured_and_says_by_what():
    rows = by_figure(targets.evaluate(hand_built_report()))
    vit = rows["vit_b_16: gpu-attach-hit spawn->ready / ideal's"]
    assert vit["verdict"] == "not measured"
    assert vit["source"] == "not measured by bench coldstart --device cuda (bench-rest timeout)"
    assert rows["resnet50: outputs vs plain ort-cuda"]["source"].startswith("not measured by verify.sh dropin")
    assert rows["a client SIGKILLed while attached releases its device lease"]["verdict"] == "not measured"
    empty = by_figure(targets.evaluate({}))
    assert {r["verdict"] for r in empty.values()} == {"not measured"}
    assert empty["gpu-marked tests"]["source"] == "not measured by pytest -m gpu (not run)"


def test_a_promotion_with_no_copy_rate_is_not_measured_rather_than_failed():
    r = hand_built_report()
    for p in r["bench"]["rest"]["promotion"]:
        p["copy_gb_s"] = 0.0
    row = by_figure(targets.evaluate(r))["resnet50: host->GPU promotion / pinned host->device bandwidth, same run"]
    assert row["verdict"] == "not measured" and "promotion_bytes_per_s" in row["source"]


def test_skipped_gpu_tests_do_not_count_as_passing():
    r = hand_built_report()
    r["tests"] = {"passed": 3, "failed": 0, "errors": 0, "skipped": 1, "failures": [], "skips": ["x: no CUDA"]}
    assert by_figure(targets.evaluate(r))["gpu-marked tests"]["verdict"] == "NOT met"


def test_outputs_on_another_provider_than_cuda_are_not_met():
    r = hand_built_report()
    r["dropin"]["models"]["vgg16"]["providers"] = ["CPUExecutionProvider"]
    row = by_figure(targets.evaluate(r))["vgg16: outputs vs plain ort-cuda"]
    assert row["verdict"] == "NOT met" and "not CUDA alone" in row["value"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_gpu_tier" name="test_a[cuda]" time="0.1"/>
<testcase classname="tests.test_gpu_tier" name="test_b[cuda]" time="0.1"><failure message="boom">x</failure></testcase>
<testcase classname="tests.test_gpu_serve" name="test_c" time="0.1"><skipped message="no CUDA device"/></testcase>
<testcase classname="tests.test_client_device" name="test_d" time="0.1"><error message="fixture">y</error></testcase>
</testsuite></testsuites>"""


def test_collect_writes_the_report_folder_from_what_the_steps_left(tmp_path):
    state, out = tmp_path / "state", tmp_path / "out" / "gpu-report"
    built = hand_built_report()
    (state / "bench" / "vgg16").mkdir(parents=True)
    (state / "bench" / "vgg16" / "results.json").write_text(json.dumps(built["bench"]["vgg16"]))
    (state / "dropin.json").write_text(json.dumps(built["dropin"]))
    (state / "junit-gpu.xml").write_text(JUNIT)
    (state / "logs").mkdir()
    (state / "logs" / "tests.log").write_text("4 tests\n")
    report.record_step(state, "tests", "failed", 1, 42, 300)
    subprocess.run([sys.executable, str(GPU / "report.py"), "collect", str(state), str(out)], check=True,
                   capture_output=True)
    # the device tool brings back at most 8 files, two folders down
    assert sorted(p.name for p in out.iterdir()) == ["junit-gpu.xml", "logs.tar.gz", "report.json", "report.md"]
    data = json.loads((out / "report.json").read_text())
    assert data["tests"]["passed"] == 1 and data["tests"]["failed"] == 1 and data["tests"]["errors"] == 1
    assert data["tests"]["skips"] == ["tests.test_gpu_serve::test_c: no CUDA device"]
    assert data["steps"]["tests"]["status"] == "failed"
    rows = by_figure(data["figures"])
    assert rows["gpu-marked tests"]["verdict"] == "NOT met"
    assert rows["vgg16: gpu-attach-hit spawn->ready / ideal's"]["verdict"] == "met"
    md = (out / "report.md").read_text()
    assert "| tests | failed (rc 1) | 42 | 300 |" in md and "| install | not run | - | - |" in md
    assert "- failed: tests.test_gpu_tier::test_b[cuda]" in md
    # the parser's command line prints the same table
    r = subprocess.run([sys.executable, str(GPU / "targets.py"), str(out / "report.json")], capture_output=True,
                       text=True, check=True)
    assert targets.table(data["figures"]) in r.stdout


# -- verify.sh where there is no GPU ----------------------------------------------------------------

def verify(*args, state, out, kit=None):
    env = {**os.environ, "MODELCACHE_GPUKIT_STATE": str(state), "OUT": str(out), "PYTHON": sys.executable,
           "MODELCACHE_GPUKIT_KIT": str(kit or state / "no-kit")}
    return subprocess.run(["bash", str(GPU / "verify.sh"), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_dry_run_prints_every_step_and_its_commands_and_runs_nothing(tmp_path):
    r = verify("--dry-run", "all", state=tmp_path / "state", out=tmp_path / "out")
    assert r.returncode == 0, r.stderr
    heads = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("== ")]
    assert heads == ["install", "probe", "dropin", "tests", "bench-vgg16", "bench-rest"]
    assert "--target" in r.stdout and "pytest -m gpu" in r.stdout
    assert "bench coldstart --device cuda --models vgg16 --runs 5 --clients 1 2 4 8" in r.stdout
    assert "tests/test_gpu_tier.py" in r.stdout     # the files that hold gpu tests, found by their mark
    assert not (tmp_path / "state").exists() and not (tmp_path / "out").exists()


def test_an_unknown_step_is_refused(tmp_path):
    r = verify("instal", state=tmp_path / "state", out=tmp_path / "out")
    assert r.returncode == 2 and "unknown step 'instal'" in r.stderr


def test_stage_then_install_with_a_call_missing_reports_which(files, tmp_path):
    """The kit's calls as a session makes them, on this machine: the install fails, and the report says why."""
    kit = tmp_path / "kit"
    chunks.split(files, kit, budget=4_000)
    carried = tmp_path / "tree" / ".gpukit"    # what call 1 brings: its folder alone
    shutil.copytree(kit / "call1", carried / "call1")
    state, out = tmp_path / "state", tmp_path / "out"
    r = verify("stage", state=state, out=out, kit=carried)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "calls [1] of 3 staged; still to come: calls [2, 3]" in r.stdout
    shutil.rmtree(carried)                     # a later call carries nothing
    r = verify("install", "probe", state=state, out=out, kit=carried)
    assert r.returncode == 1
    assert "call(s) [2, 3] of 3 never arrived" in r.stdout
    data = json.loads((out / "gpu-report" / "report.json").read_text())
    assert data["steps"]["stage"]["status"] == "ok" and data["steps"]["install"]["status"] == "failed"
    assert "probe" not in data["steps"]         # nothing after a failed install runs


def test_a_step_with_too_little_time_left_is_skipped_and_reported(tmp_path):
    out = tmp_path / "out"
    r = verify("--budget", "10", "probe", state=tmp_path / "state", out=out)
    assert r.returncode == 1 and "probe: skipped" in r.stdout
    assert json.loads((out / "gpu-report" / "report.json").read_text())["steps"]["probe"]["status"] == "skipped"


def test_dropin_rehearses_its_whole_flow_on_the_cpu(tmp_path):
    """Daemon, add, fresh processes for each mode, outputs compared: what runs on the GPU, here on the CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(GPU / "dropin.py"), "--device", "cpu", "--models", "tiny-cnn",
                        "--rounds", "1", "--out", str(tmp_path / "dropin.json")], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "dropin.json").read_text())
    got = data["models"]["tiny-cnn"]
    assert got["providers"] == ["CPUExecutionProvider"]
    assert got["vs_ort_cuda"]["max_rel_diff"] < 1e-5
    assert {s["mode"] for s in data["samples"]} == {"modelcache", "ort-cuda", "ort-cuda-basic"}
    assert all(0 < s["ready_ms"] < s["first_ms"] for s in data["samples"])


def test_probe_without_a_gpu_writes_what_it_found_and_fails(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(GPU / "probe.py"), "--out", str(tmp_path / "device.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1      # no session ran on the CUDA provider here
    info = json.loads((tmp_path / "device.json").read_text())
    assert info["python"] and "packages" in info and info["onnxruntime"]["session"]["providers"][0] != \
        "CUDAExecutionProvider"
    assert report.device_line(info).startswith("device: ?")
