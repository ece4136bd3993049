"""benchmarks/gpu: the kit a 15-minute GPU session carries (split, staged call by call, reassembled, checked by
sha256), the plan's calls and their time sum, the checks' runner and contract, the report and its figures against
issue #36's targets, and verify.sh's steps that need no GPU. Small fake files: nothing is downloaded.
Run from the repository root: PYTHONPATH=. python -m pytest -q benchmarks/tests/test_gpu_kit.py"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "benchmarks" / "gpu"
sys.path.insert(0, str(GPU))          # as the kit's scripts import each other: one module each
import checks  # noqa: E402
import chunks  # noqa: E402
import plan  # noqa: E402
import prepare  # noqa: E402
import report  # noqa: E402
import targets  # noqa: E402
from chunks import KitError  # noqa: E402


@pytest.fixture
def files(tmp_path):
    """A 'pyzmq' that must come first, a 'kit' too big for one call, and its record, bytes differing everywhere."""
    src = tmp_path / "src"
    src.mkdir()
    sizes = {"pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl": 1_500, "ort-kit-1.31.1-sm_90a.tar.xz.json": 7,
             "ort-kit-1.31.1-sm_90a.tar.xz": 10_000}
    out = []
    for name, size in sizes.items():
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


# -- the kit's parts --------------------------------------------------------------------------------

def test_split_keeps_the_order_given_fits_each_call_and_reassembles_byte_identical(files, tmp_path):
    kit, state = tmp_path / ".gpukit", tmp_path / "state"
    manifest = chunks.split(files, kit, budget=4_000)
    assert manifest["calls"] == 3          # 11.5 kB end to end in three calls of 3836 bytes
    for n in range(1, 4):
        parts = [p for p in (kit / f"call{n}").iterdir() if p.name != chunks.MANIFEST]
        assert sum(p.stat().st_size for p in parts) <= 4_000
        assert json.loads((kit / f"call{n}" / chunks.MANIFEST).read_text()) == manifest
    zmq, record, big = (manifest["files"][f.name] for f in files)
    assert [p["call"] for p in zmq["parts"]] == [1] and [p["call"] for p in record["parts"]] == [1]   # first: whole
    assert [(p["call"], p["size"]) for p in big["parts"]] == [(1, 2_329), (2, 3_836), (3, 3_835)]
    assert big["sha256"] == chunks.sha256_file(files[2])

    progress = carry_one_call_at_a_time(kit, state, [1, 2, 3])
    assert [p["missing"] for p in progress] == [[2, 3], [3], []]
    rebuilt = chunks.assemble(state, tmp_path / "files")
    assert sorted(p.name for p in rebuilt) == sorted(f.name for f in files)
    for f in files:
        assert (tmp_path / "files" / f.name).read_bytes() == f.read_bytes()


def test_a_file_whose_parts_came_is_assembled_before_the_rest_arrives(files, tmp_path):
    kit, state = tmp_path / ".gpukit", tmp_path / "state"
    chunks.split(files, kit, budget=6_000)
    carry_one_call_at_a_time(kit, state, [1])
    [zmq] = chunks.assemble(state, tmp_path / "files", ["pyzmq-*.whl"])
    assert zmq.read_bytes() == files[0].read_bytes()
    with pytest.raises(KitError, match=r"call\(s\) \[2\] of 2 never arrived"):
        chunks.assemble(state, tmp_path / "files", ["ort-kit-*"])
    with pytest.raises(KitError, match="holds no file named like nothing-*"):
        chunks.assemble(state, tmp_path / "files", ["nothing-*"])


@pytest.mark.parametrize("sizes, budget", [({"a": 10, "b": 10, "c": 10}, 10), ({"a": 1, "b": 0, "c": 99}, 7),
                                           ({"z": 855_178, "j": 700, "w": 58_821_352}, 60_000_000)])
def test_the_plan_takes_the_fewest_calls_and_covers_every_byte_once(sizes, budget):
    calls = chunks.plan(sizes, budget)
    assert len(calls) == -(-sum(sizes.values()) // budget)
    assert all(sum(p[3] for p in call) <= budget for call in calls)
    for name, size in sizes.items():
        cut = sorted((p[2], p[3]) for call in calls for p in call if p[0] == name)
        assert cut[0][0] == 0 and sum(length for _, length in cut) == size
        assert all(a + la == b for (a, la), (b, _) in zip(cut, cut[1:]))   # contiguous, no overlap


def test_a_corrupted_part_is_caught_when_it_arrives(files, tmp_path):
    kit = tmp_path / ".gpukit"
    manifest = chunks.split(files, kit, budget=4_000)
    part = next(p for p in manifest["files"][files[2].name]["parts"] if p["call"] == 2)
    path = kit / "call2" / part["name"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(KitError, match=rf"carried part .*{part['name']}: sha256 .* the manifest says .*corrupt"):
        chunks.stage(kit, tmp_path / "state")
    r = subprocess.run([sys.executable, str(GPU / "chunks.py"), "stage", str(kit), str(tmp_path / "state")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert r.stderr.startswith("gpukit: carried part") and "corrupt" in r.stderr and r.stderr.count("\n") == 1


def test_a_part_corrupted_after_staging_is_caught_at_assembly_and_mended_by_carrying_it_again(files, tmp_path):
    kit, state = tmp_path / ".gpukit", tmp_path / "state"
    manifest = chunks.split(files, kit, budget=4_000)
    chunks.stage(kit, state)
    staged = state / "parts" / manifest["kit"] / manifest["files"][files[0].name]["parts"][0]["name"]
    staged.write_bytes(b"x" * staged.stat().st_size)
    with pytest.raises(KitError, match=rf"staged part {staged.name}: sha256.*carry it again"):
        chunks.assemble(state, tmp_path / "files")
    assert not (tmp_path / "files" / files[0].name).exists()
    chunks.stage(kit, state)
    chunks.assemble(state, tmp_path / "files")
    assert (tmp_path / "files" / files[0].name).read_bytes() == files[0].read_bytes()


def test_a_fresh_machine_says_start_again_from_call_1(tmp_path):
    with pytest.raises(KitError, match="this machine is fresh.*from call 1"):
        chunks.assemble(tmp_path / "state", tmp_path / "files")


def test_parts_of_two_kits_are_refused(files, tmp_path):
    chunks.split(files[:1], tmp_path / "a", budget=4_000)
    chunks.split(files[1:], tmp_path / "b", budget=40_000)
    kit = tmp_path / ".gpukit"
    shutil.copytree(tmp_path / "a" / "call1", kit / "call1")
    shutil.copytree(tmp_path / "b" / "call1", kit / "call2")
    with pytest.raises(KitError, match="parts of 2 different kits"):
        chunks.stage(kit, tmp_path / "state")


def test_no_room_beside_the_working_tree_is_a_clear_error(files, tmp_path):
    with pytest.raises(KitError, match="no room for weights in a call"):
        chunks.split(files, tmp_path / ".gpukit", budget=-5)


# -- the plan ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kit_calls", [1, 2])
def test_the_plan_fits_the_session_with_margin(kit_calls):
    seq = plan.calls(kit_calls)
    assert len(seq) <= 3 and all(c.timeout_s <= 600 for c in seq)
    assert plan.total_s(seq) <= 12 * 60            # cold start, every call to its limit, transfers
    assert plan.expected_s(seq) <= 9 * 60
    assert [c.carry for c in seq[:kit_calls]] == [(f".gpukit/call{n}",) for n in range(1, kit_calls + 1)]
    assert all(not c.carry for c in seq[kit_calls:])
    for c in seq:
        # what a call's steps are expected to take fits its budget, with a third to spare
        assert c.estimate_s * 1.3 <= c.timeout_s - plan.CALL_REPORT_S, c
    done = []
    for c in seq[:-1]:          # each step after what it needs, the kit staged before it is unpacked
        for s in c.steps:
            assert set(plan.STEPS[s].needs) <= set(done), (s, done)
            done.append(s)
    assert done.index("tier") < done.index("ort")   # the tier's report comes first, whatever the kit does
    assert seq[-1].steps == ("again",)


def test_the_plan_is_refused_when_the_kit_takes_three_calls():
    with pytest.raises(plan.PlanError, match="the kit needs 3 calls"):
        plan.calls(3)


def test_the_printed_plan_names_each_call_and_the_total():
    text = plan.describe(plan.calls(1))
    assert "1. run(command='bash benchmarks/gpu/verify.sh --budget 225 stage zmq tier ort probe', " \
           "carry=['.gpukit/call1'], timeout_s=240)" in text
    assert "3. run(command='bash benchmarks/gpu/verify.sh --budget 60 again', carry=[], timeout_s=75)" in text
    assert f"Plan total: {plan.total_s(plan.calls(1)) // 60}:" in text and "(limit 12:00)" in text


def test_the_readme_gives_the_plans_calls():
    text = (GPU / "README.md").read_text()
    for call in plan.calls(1):
        assert f"`{call.command}`, `{json.dumps(list(call.carry))}`, {call.timeout_s} |" in text, call.command


def test_verify_sh_takes_its_limits_from_the_plan():
    r = subprocess.run([sys.executable, str(GPU / "plan.py"), "bash"], capture_output=True, text=True, check=True)
    assert "CAP[bench]=200; NEEDS[bench]=\"probe\"" in r.stdout and f'ORDER="{" ".join(plan.ORDER)}"' in r.stdout


# -- prepare.py (its parts that need no download) ---------------------------------------------------

def test_prepare_finds_a_wheel_already_there_and_refuses_unpinned_packages(files, tmp_path):
    assert prepare.wheel_for("pyzmq==27.3.0", files[0].parent) == files[0]
    assert prepare.wheel_for("pyzmq==27.3.1", files[0].parent) is None
    assert prepare.fetch(["pyzmq==27.3.0"], files[0].parent) == [files[0]]    # no download: it is there
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
    for path in (".gpukit/call1/x.whl.part01of02", ".gpukit-wheels/ort-kit.tar.xz", ".gpukit-tools/nvidia/x"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path


# -- the checks: runner and contract ----------------------------------------------------------------

CHECK = '''
import sys, time
sys.path.insert(0, {gpu!r})
from checks import main_for
LIMIT_S = {limit}
def body(r):
{body}
sys.exit(main_for({name!r}, body))
'''


def fake_checks(folder: Path, bodies: dict) -> None:
    for name, (limit, body) in bodies.items():
        (folder / f"check_{name}.py").write_text(CHECK.format(gpu=str(GPU), limit=limit, name=name,
                                                              body=textwrap.indent(body, "    ")))


def test_the_runner_runs_every_check_under_its_limit_and_keeps_what_each_measured(tmp_path):
    folder, out = tmp_path / "kit", tmp_path / "out"
    folder.mkdir()
    fake_checks(folder, {
        "a_ok": (20, "r.set('answer', 42)"),
        "b_failed": (20, "r.set('lease_count', 1)\nr.require(False, 'one lease for two clients')\nr.set('after', 1)"),
        "c_slow": (10, "r.set('before_the_hang', True)\ntime.sleep(60)"),
        "d_crash": (20, "import os; os._exit(3)"),
        "e_cannot": (20, "from checks import CannotRun\nraise CannotRun('no CUDA device here')"),
    })
    (folder / "check_f_silent.py").write_text("import sys; print('no result', file=sys.stderr); sys.exit(5)\n")
    assert [(n, limit) for n, _, limit in checks.discover(folder)] == [
        ("a_ok", 20), ("b_failed", 20), ("c_slow", 10), ("d_crash", 20), ("e_cannot", 20), ("f_silent", 60)]
    results = checks.run_all(out, 40, folder, log=lambda text: None)
    status = {n: r["status"] for n, r in results.items()}
    assert status == {"a_ok": "ok", "b_failed": "failed", "c_slow": "timeout", "d_crash": "error",
                      "e_cannot": "error", "f_silent": "error"}
    assert results["a_ok"]["figures"] == {"answer": 42}
    assert results["b_failed"]["figures"] == {"lease_count": 1, "after": 1}     # the check went on
    assert results["b_failed"]["error"] == "one lease for two clients"
    assert results["c_slow"]["figures"] == {"before_the_hang": True}            # kept across the kill
    assert results["c_slow"]["error"] == "stopped at its limit of 10 s"
    assert "exited before finishing" in results["d_crash"]["error"]
    assert results["e_cannot"]["error"] == "CannotRun: no CUDA device here"
    assert "no result written" in results["f_silent"]["error"] and "no result" in results["f_silent"]["error"]
    for name in status:
        assert json.loads((out / f"check_{name}.json").read_text())["status"] == status[name]


def test_a_check_with_no_time_left_is_skipped_and_an_earlier_result_stands(tmp_path):
    folder = tmp_path / "kit"
    folder.mkdir()
    fake_checks(folder, {"a": (20, "r.set('x', 1)"), "b": (20, "r.set('y', 2)")})
    assert checks.run_all(tmp_path / "out", 5, folder, log=lambda t: None)["a"]["status"] == "skipped"
    assert checks.run_all(tmp_path / "out", 60, folder, log=lambda t: None)["a"]["status"] == "ok"
    again = checks.run_all(tmp_path / "out", 5, folder, log=lambda t: None)    # run again with no time
    assert again["a"] == again["a"] | {"status": "ok", "figures": {"x": 1}}
    assert json.loads((tmp_path / "out" / "check_b.json").read_text())["figures"] == {"y": 2}


@pytest.mark.parametrize("name", ["ipc", "pinned"])
def test_the_real_checks_say_they_cannot_run_without_a_gpu(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(GPU / f"check_{name}.py"), "--out", str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 2, r.stdout + r.stderr
    data = json.loads((tmp_path / f"check_{name}.json").read_text())
    assert data["status"] == "error" and data["error"].startswith("CannotRun: ")
    assert "device" in data["error"] or "driver" in data["error"]


def test_the_ipc_check_rehearses_its_flow_on_fake_devices(tmp_path):
    """The real daemon lends over its fake GPU tier (files for device memory) to two importer processes: bytes,
    leases, the refused eviction, SIGKILLs and the final eviction, as on the GPU less the memory figures."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(GPU / "check_ipc.py"), "--out", str(tmp_path), "--rehearse"],
                       capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "check_ipc.json").read_text())
    f = data["figures"]
    assert data["status"] == "ok" and f["rehearsal"] is True and f["allocator"] == f["ipc_kind"] == "fake"
    assert f["bytes_identical"] is True and f["tensors_checked"] > 0
    assert f["lease_count_two_clients"] == 2 and f["evict_refused_under_lease"] is True
    assert "cannot be evicted" in f["evict_refusal"]
    assert f["killed_client_lease_released"] is True and all(0 < s < 10 for s in f["killed_client_lease_released_s"])
    assert f["memory_returned"] is True
    rows = by_figure(targets.evaluate({"checks": {"ipc": data}}))
    assert rows["a SIGKILLed attached client releases its device lease"]["verdict"] == "met"


# -- the report and its figures ---------------------------------------------------------------------

def samples(model, **modes):
    """Five samples per mode, spread around the given (ready, first) medians."""
    return [{"model": model, "mode": mode, "ready_ms": ready + d, "first_ms": first + d, "run": i}
            for mode, (ready, first) in modes.items() for i, d in enumerate((-20, -10, 0, 10, 20))]


IPC_FIGURES = {"bytes_identical": True, "tensors_checked": 161, "lease_count_two_clients": 2,
               "evict_refused_under_lease": True, "evict_refused_freed_mib": 0.0, "arena_mib": 98.0,
               "killed_client_lease_released": True, "killed_client_lease_released_s": [1.1, 1.2],
               "memory_returned_after_last_importer_mib": 98.0,
               "raw_bytes_intact_after_exporter_freed_and_exited": True, "raw_held_by_importer_alone_mib": 250.0,
               "raw_allocation_mib": 256.0, "import_extra_mib": 2.0, "importer_client_mib": 520.0}
PINNED_FIGURES = {"read_only_register_accepted": True, "copy_in_vs_pinned": 0.93, "copy_in_gb_s": 51.0,
                  "pinned_gb_s": 54.7, "pageable_gb_s": 7.3}


def hand_built_report():
    vgg = {"device": "NVIDIA H200 (abc)",
           "samples": samples("vgg16", **{"ort-cuda": (1900, 2120), "gpu-attach-hit": (560, 840),
                                          "ideal": (540, 630), "serve": (300, 400)}),
           "memory": [{"model": "vgg16", "mode": "arena", "clients": 0, "device_mib": 530, "weights_mib": 528},
                      {"model": "vgg16", "mode": "floor", "clients": 1, "device_mib": 732},
                      {"model": "vgg16", "mode": "gpu-attach-hit", "clients": 4, "device_mib": 4 * 733}],
           "promotion": [{"model": "vgg16", "copy_gb_s": g, "load_gb_s": 1.0, "bytes": 1} for g in (40, 41, 42)],
           "bandwidth": {"bytes": 1, "pageable_gb_s": 7.3, "pinned_gb_s": 54.7}}
    same = {"max_abs_diff": 0.0, "max_rel_diff": 0.0, "bit_identical": True}
    dropin = {"models": {"vgg16": {"providers": ["CUDAExecutionProvider"], "vs_ort_cuda": same,
                                   "vs_ort_cuda_basic": same}}}
    return {"steps": {"tier": {"status": "ok", "rc": 0, "seconds": 90, "limit_s": 150, "why": ""}},
            "tests": {"tier": {"passed": 11, "failed": 0, "errors": 0, "skipped": 0, "failures": [], "skips": []},
                      "ort": None},
            "checks": {"ipc": {"status": "ok", "figures": dict(IPC_FIGURES)},
                       "pinned": {"status": "ok", "figures": dict(PINNED_FIGURES)}},
            "dropin": dropin, "bench": {"vgg16": vgg}}


def by_figure(rows):
    return {r["figure"]: r for r in rows}


def test_each_target_is_met_or_not_from_a_hand_built_report():
    rows = by_figure(targets.evaluate(hand_built_report()))
    met = lambda f: rows[f]["verdict"]  # noqa: E731
    assert met("gpu-marked tests, gpu and not cuda_ep") == "met"
    assert met("vgg16: gpu-attach-hit spawn->ready / ideal's") == "met"          # 560 / 540 = 1.04
    assert rows["vgg16: gpu-attach-hit spawn->ready / ideal's"]["value"].startswith("1.04x")
    assert met("vgg16: gpu-attach-hit spawn->first result, speedup over ort-cuda") == "met"   # 2120 / 840 = 2.52
    assert met("vgg16: serve spawn->first result, speedup over ort-cuda") == "NOT met"        # 2120 / 400 = 5.3
    memory = rows["vgg16: device memory, daemon + 4 gpu-attach clients started together"]
    assert memory["verdict"] == "met" and memory["value"].startswith("3462 MiB vs bound 3482 MiB")
    assert met("vgg16: host->GPU promotion / pinned host->device bandwidth, same run") == "NOT met"   # 41 / 54.7
    assert met("vgg16: outputs vs plain ort-cuda") == "met"
    assert met("vgg16: outputs vs plain ort-cuda over the BASIC-optimized graph") == "met"
    assert met("a SIGKILLed attached client releases its device lease") == "met"
    assert rows["a SIGKILLed attached client releases its device lease"]["value"] == "after [1.1, 1.2] s"
    assert met("eviction never frees memory a live lease maps") == "met"
    assert met("imported memory outlives its exporter's cudaFree and exit, and goes with the last importer") == "met"
    promo = rows["host->GPU copy from a read-only /dev/shm mapping (the tier's copy_in) / pinned bandwidth"]
    assert promo["verdict"] == "met" and promo["value"].startswith("0.93 (51.0 / 54.7 GB/s")
    assert promo["source"] == "check_pinned.py"


def test_what_the_report_does_not_hold_is_not_measured_and_says_by_what():
    r = hand_built_report()
    r["steps"]["tests"] = {"status": "skipped", "rc": 0, "seconds": 0, "limit_s": 90, "why": "needs probe (failed)"}
    rows = by_figure(targets.evaluate(r))
    ort_tests = rows["gpu-marked tests, gpu and cuda_ep"]
    assert ort_tests["verdict"] == "not measured"
    assert ort_tests["source"] == "not measured by pytest -m 'gpu and cuda_ep' (tests skipped: needs probe (failed))"
    vmm = rows["step 2: a client's write to a read-only (VMM) weight fails"]
    assert vmm["verdict"] == "not measured" and vmm["source"] == "not measured by check_vmm.py (no check_vmm.json; " \
                                                                 "tier ok)"
    empty = by_figure(targets.evaluate({}))
    assert {r["verdict"] for r in empty.values()} == {"not measured"}
    assert empty["gpu-marked tests, gpu and not cuda_ep"]["source"] == \
        "not measured by pytest -m 'gpu and not cuda_ep' (not run)"
    assert empty["a SIGKILLed attached client releases its device lease"]["source"] == \
        "not measured by check_ipc.py (not run)"


def test_a_check_that_stopped_early_is_named_with_the_figure_it_lacks():
    r = hand_built_report()
    del r["checks"]["ipc"]["figures"]["killed_client_lease_released"]
    r["checks"]["ipc"].update(status="timeout", error="stopped at its limit of 90 s")
    row = by_figure(targets.evaluate(r))["a SIGKILLed attached client releases its device lease"]
    assert row["verdict"] == "not measured"
    assert row["source"] == "not measured by check_ipc.py (timeout: stopped at its limit of 90 s)"


def test_step_2_figures_come_from_check_vmm():
    r = hand_built_report()
    r["checks"]["vmm"] = {"status": "ok", "figures": {
        "write_refused": True, "attach_ms_vmm": [2.1, 2.3, 2.2], "attach_ms_ipc": [1.9, 2.0, 2.1],
        "device_mib_vmm": 1100.0, "device_mib_ipc": 1046.0, "killed_client_mapping_released": False}}
    rows = by_figure(targets.evaluate(r))
    assert rows["step 2: a client's write to a read-only (VMM) weight fails"]["verdict"] == "met"
    attach = rows["step 2: attach time, read-only VMM vs legacy IPC"]
    assert attach["verdict"] == "met" and attach["value"] == "2.20 vs 2.00 ms (medians)"   # 1.1x
    assert rows["step 2: device memory, read-only VMM vs legacy IPC"]["verdict"] == "NOT met"   # 1.052x, +54 MiB
    assert rows["step 2: a killed client's mapping goes with its fd"]["verdict"] == "NOT met"


def test_skipped_gpu_tests_do_not_count_as_passing():
    r = hand_built_report()
    r["tests"]["tier"] = {"passed": 3, "failed": 0, "errors": 0, "skipped": 1, "failures": [], "skips": ["x"]}
    assert by_figure(targets.evaluate(r))["gpu-marked tests, gpu and not cuda_ep"]["verdict"] == "NOT met"


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
    (state / "junit-tier.xml").write_text(JUNIT)
    (state / "checks").mkdir()
    (state / "checks" / "check_ipc.json").write_text(json.dumps(built["checks"]["ipc"]))
    (state / "device.json").write_text(json.dumps({"cuda_ep": {"ok": False, "why": "CUDA error: no kernel image",
                                                               "fallback": "tier results stand"}}))
    (state / "files").mkdir()
    (state / "files" / "ort-kit-1.31.1-sm_90a.tar.xz.json").write_text(json.dumps({"kit_bytes": 58821352}))
    (state / "logs").mkdir()
    (state / "logs" / "tier.log").write_text("11 tests\n")
    report.record_step(state, "tier", "failed", 1, 42, 150)
    report.record_step(state, "tests", "skipped", 0, 0, 90, "needs probe (failed)")
    subprocess.run([sys.executable, str(GPU / "report.py"), "collect", str(state), str(out)], check=True,
                   capture_output=True)
    assert sorted(p.name for p in out.iterdir()) == ["junit-tier.xml", "logs.tar.gz", "report.json", "report.md"]
    data = json.loads((out / "report.json").read_text())
    assert data["tests"]["tier"]["passed"] == 1 and data["tests"]["tier"]["failed"] == 1
    assert data["tests"]["tier"]["skips"] == ["tests.test_gpu_serve::test_c: no CUDA device"]
    assert data["kit"]["built"] == {"kit_bytes": 58821352}
    assert data["checks"]["ipc"]["figures"]["lease_count_two_clients"] == 2
    rows = by_figure(data["figures"])
    assert rows["gpu-marked tests, gpu and not cuda_ep"]["verdict"] == "NOT met"
    assert rows["leases counted for 2 importing clients"]["verdict"] == "met"
    md = (out / "report.md").read_text()
    assert "**FALLBACK**: CUDA error: no kernel image: tier results stand." in md
    assert "| tier | failed (rc 1) | 42 | 150 |  |" in md and "| tests | skipped (rc 0) | 0 | 90 | needs probe (failed) |" in md
    assert "| ort | not run | - | - | |" in md and "- failed: tests.test_gpu_tier::test_b[cuda]" in md
    assert "| ipc | ok |" in md
    r = subprocess.run([sys.executable, str(GPU / "targets.py"), str(out / "report.json")], capture_output=True,
                       text=True, check=True)
    assert targets.table(data["figures"]) in r.stdout
    assert subprocess.run([sys.executable, str(GPU / "report.py"), "status", str(state), "tests"],
                          capture_output=True, text=True).stdout == "skipped\n"
    assert subprocess.run([sys.executable, str(GPU / "report.py"), "status", str(state), "bench"],
                          capture_output=True, text=True).stdout == "not run\n"


# -- verify.sh where there is no GPU ----------------------------------------------------------------

def verify(*args, state, out, kit=None):
    env = {**os.environ, "MODELCACHE_GPUKIT_STATE": str(state), "OUT": str(out), "PYTHON": sys.executable,
           "MODELCACHE_GPUKIT_KIT": str(kit or state / "no-kit")}
    return subprocess.run(["bash", str(GPU / "verify.sh"), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_dry_run_prints_each_calls_steps_and_commands_and_runs_nothing(tmp_path):
    for call in plan.calls(1)[:2]:
        r = verify("--dry-run", *call.command.split()[2:], state=tmp_path / "state", out=tmp_path / "out")
        assert r.returncode == 0, r.stderr
        heads = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("== ")]
        assert heads == list(call.steps)
    r = verify("--dry-run", "--budget", "225", "stage", "zmq", "tier", "ort", "probe", state=tmp_path / "state",
               out=tmp_path / "out")
    assert "checks.py run --out" in r.stdout and "pytest -o addopts= -m gpu and not cuda_ep" in r.stdout
    assert "ortkit.py unpack" in r.stdout and "== probe (up to 60 s; needs: ort)" in r.stdout
    r = verify("--dry-run", "tests", "bench", "dropin", state=tmp_path / "state", out=tmp_path / "out")
    assert f"bench coldstart --device cuda {plan.BENCH_ARGS}" in r.stdout and "pytest -o addopts= -m gpu and cuda_ep" in r.stdout
    assert "tests/test_gpu_tier.py" in r.stdout     # the files that hold gpu tests, found by their mark
    assert not (tmp_path / "state").exists() and not (tmp_path / "out").exists()


def test_an_unknown_step_is_refused(tmp_path):
    r = verify("instal", state=tmp_path / "state", out=tmp_path / "out")
    assert r.returncode == 2 and "unknown step 'instal'" in r.stderr


def fake_pyzmq(folder: Path) -> Path:
    """A wheel that imports as zmq: what the zmq step unpacks and imports."""
    path = folder / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("zmq/__init__.py", "__version__ = '27.3.0'\ndef zmq_version():\n    return '4.3.5'\n")
    return path


def test_the_first_call_unpacks_pyzmq_and_a_kit_part_missing_skips_what_needs_it(tmp_path):
    """A kit in two calls, only the first carried: pyzmq is there, the onnxruntime kit is not; what needs the CUDA
    provider is skipped, and the report says why, step by step."""
    src = tmp_path / "src"
    src.mkdir()
    kitfile = src / "ort-kit-1.31.1-sm_90a.tar.xz"
    kitfile.write_bytes(os.urandom(5_000))
    chunks.split([fake_pyzmq(src), kitfile], tmp_path / "kit", budget=3_000)
    carried = tmp_path / "tree" / ".gpukit"
    shutil.copytree(tmp_path / "kit" / "call1", carried / "call1")
    state, out = tmp_path / "state", tmp_path / "out"
    r = verify("stage", "zmq", "ort", "probe", "tests", state=state, out=out, kit=carried)
    assert r.returncode == 1
    assert "calls [1] of 2 staged; still to come: calls [2]" in r.stdout
    assert "pyzmq 27.3.0 libzmq 4.3.5" in r.stdout
    assert "call(s) [2] of 2 never arrived" in r.stdout
    data = json.loads((out / "gpu-report" / "report.json").read_text())
    status = {k: (v["status"], v["why"]) for k, v in data["steps"].items()}
    assert status == {"stage": ("ok", ""), "zmq": ("ok", ""), "ort": ("failed", ""),
                      "probe": ("skipped", "needs ort (failed)"), "tests": ("skipped", "needs probe (skipped)")}
    r = verify("again", state=state, out=out, kit=carried)       # what did not end ok, once more
    ran = dict.fromkeys(line.split()[1].rstrip(":") for line in r.stdout.splitlines() if line.startswith("== "))
    assert list(ran) == ["ort", "probe", "tests", "report"]


def test_a_step_with_too_little_time_left_is_skipped_and_reported(tmp_path):
    out = tmp_path / "out"
    r = verify("--budget", "10", "zmq", state=tmp_path / "state", out=out)
    assert r.returncode == 1 and "zmq: skipped, " in r.stdout
    step = json.loads((out / "gpu-report" / "report.json").read_text())["steps"]["zmq"]
    assert step["status"] == "skipped" and "left of the call's budget" in step["why"]


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


def test_probe_without_a_gpu_writes_what_it_found_and_says_the_fallback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(GPU / "probe.py"), "--out", str(tmp_path / "device.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1      # no session ran on the CUDA provider here
    assert "FALLBACK: the compacted CUDA provider did not run here" in r.stderr
    info = json.loads((tmp_path / "device.json").read_text())
    assert info["python"] and "packages" in info
    assert info["onnxruntime"]["session"]["providers"][0] != "CUDAExecutionProvider"
    assert info["onnxruntime"]["eager_loading"]["module_loading"] == "EAGER"
    assert info["cuda_ep"]["ok"] is False and info["cuda_ep"]["eager_ok"] is False
    assert report.device_line(info).startswith("device: ?")
