"""Writers that share a repository never collide, and full or read-only storage is said plainly.

Concurrent offline adds, a writer killed mid-pack, a full disk during add (in ONNX Runtime's write
and in ours), a full /dev/shm during promotion, a read-only repository. The file systems are real
tmpfs mounts where the test may mount them (root), skipped elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from modelcache import zoo
from modelcache.errors import PackError, StorageError
from modelcache.store import reservations
from modelcache.store.packing import pack
from modelcache.tiers.disk import Repository
from conftest import HERE, DaemonProcess, stop_cleanly


# -- writers that share a repository ---------------------------------------------------------------

def test_eight_offline_adds_of_one_name_get_eight_versions(tmp_path, zoo_file):
    """`modelcache add` with no daemon, eight at once: each gets its own version, none fails."""
    env = {**os.environ, "MODELCACHE_SOCKET": f"ipc://{tmp_path}/none.sock",
           "MODELCACHE_REPOSITORY": str(tmp_path / "repo"), "MODELCACHE_CONFIG": ""}
    procs = [subprocess.Popen([sys.executable, "-m", "modelcache.cli", "add", zoo_file("tiny-cnn"), "--name", "m"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE)
             for _ in range(8)]
    outs = [(p.wait(timeout=300), p.stdout.read()) for p in procs]
    assert [rc for rc, _ in outs] == [0] * 8, outs
    found = sorted(m.version for _, m in Repository(tmp_path / "repo").scan())
    assert found == list(range(1, 9))
    assert not list((tmp_path / "repo").glob(".tmp-*"))


def test_a_version_being_written_is_neither_taken_nor_swept(tmp_path, zoo_file):
    repo = tmp_path / "repo"
    held = reservations.reserve(repo, "m", None)
    assert held.version == 1
    try:
        Repository(repo).scan()  # sweeps: must leave a live writer's directory alone
        assert held.tmp.is_dir()
        with pytest.raises(PackError, match="being added by another process"):
            pack(zoo_file("tiny-cnn"), repo, "m", 1)
        assert pack(zoo_file("tiny-cnn"), repo, "m", None).version == 2
    finally:
        reservations.abandon(held)


def test_a_killed_writer_is_swept_and_its_version_reused(tmp_path):
    repo = tmp_path / "repo"
    code = ("import pathlib, sys; from modelcache.store import reservations; "
            f"r = reservations.reserve(pathlib.Path({str(repo)!r}), 'm', None); print(r.tmp, flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=HERE)
    tmp = Path(proc.stdout.readline().strip())
    assert tmp.is_dir()
    Repository(repo).scan()
    assert tmp.is_dir(), "swept while its writer was alive"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    Repository(repo).scan()
    assert not tmp.exists()
    assert reservations.reserve(repo, "m", None).version == 1


# -- full and read-only storage --------------------------------------------------------------------

def test_a_full_disk_during_ort_optimization_says_no_space(small_tmpfs, zoo_file):
    """ORT writes the optimized copy first and loses ENOSPC in its message: ours says it."""
    repo = small_tmpfs("2m")  # the 5 MB squeezenet's optimized copy cannot fit
    with pytest.raises(StorageError, match=r"no space left on device: adding sq@1 .*MiB free") as e:
        pack(zoo_file("squeezenet1_1"), repo, "sq", None)
    assert str(repo) in str(e.value)
    assert not list(repo.glob(".tmp-*")), "a failed add left its temp dir"


def test_a_full_disk_while_writing_weights_names_the_file_and_model(small_tmpfs, zoo_file):
    repo = small_tmpfs("7m")  # ORT's 5 MB optimized copy fits; the packed weights beside it do not
    with pytest.raises(StorageError, match=r"no space left on device: adding sq@1 failed writing .*") as e:
        pack(zoo_file("squeezenet1_1"), repo, "sq", None)
    assert str(repo) in str(e.value)
    assert not list(repo.glob(".tmp-*"))


def test_a_read_only_repository_says_so(small_tmpfs, zoo_file):
    repo = small_tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(repo)], check=True)
    with pytest.raises(StorageError, match=rf"read-only file system: adding m to the repository .*{repo}"):
        pack(zoo_file("tiny-cnn"), repo, "m", None)
    assert Repository(repo).scan() == []  # a daemon can still start over it


def test_the_daemon_reports_full_storage_and_stays_up(tmp_path, small_tmpfs, zoo_file):
    """A full disk during a daemon add and a full /dev/shm during promotion: typed errors naming the model,
    nothing left behind in either, and the daemon keeps serving what fits."""
    shm = small_tmpfs("3m", "shm")  # squeezenet's 5 MB of weights cannot be promoted here
    d = DaemonProcess(tmp_path, {"MODELCACHE_SHM_DIR": str(shm)})
    d.repository.parent.mkdir(parents=True, exist_ok=True)
    d.repository.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d.repository)], check=True)
    d.start()
    try:
        with d.client() as c:
            c.add(zoo_file("squeezenet1_1"), "sq")  # fits the disk: ~20 MB while packing, 10 MB after
            with pytest.raises(StorageError, match=r"no space left on device: promoting sq@1 to the host tier"):
                c.open("sq")
            assert not [p.name for p in shm.rglob("*") if p.suffix == ".loading"]
            with pytest.raises(StorageError, match=r"no space left on device: adding sq@2"):
                c.add(zoo_file("squeezenet1_1"), "sq")  # a second copy does not fit the disk
            assert not list(d.repository.glob(".tmp-*"))
            c.add(zoo_file("tiny-cnn"), "cnn")
            feeds = zoo.sample_inputs(zoo_file("tiny-cnn"), batch=1)
            outputs, _ = c.infer("cnn", feeds)
            assert np.isfinite(next(iter(outputs.values()))).all()
        stop_cleanly(d)
        assert not list(shm.iterdir()), "the daemon left its host tier behind"
    finally:
        d.kill()
        subprocess.run(["umount", "-l", str(d.repository)], check=False)


# -- a host tier on huge pages -------------------------------------------------------------------

def _big_weight_model(path: Path) -> None:
    """y = x @ W with W 1024 x 1024 fp32 (4 MiB): two 2 MiB pages' worth of weight."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "big",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_a_host_tier_on_a_huge_page_tmpfs_maps_into_clients_2_mib_at_a_time(tmp_path, small_tmpfs):
    """shm_dir on a tmpfs mounted huge=within_size: a client's first run maps the weights with 2 MiB
    pages, not one 4 KiB page at a time (`modelcache bench pagefaults` has the cost of each)."""
    import modelcache
    import onnxruntime as ort

    shm = small_tmpfs("256M", "huge", "huge=within_size")
    src = tmp_path / "big.onnx"
    _big_weight_model(src)
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_SHM_DIR": str(shm)}).start()
    try:
        with d.client() as c:
            c.add(str(src), "big")
            with modelcache.InferenceSession("big", client=c) as sess:
                x = np.ones((1, 1024), np.float32)
                y = sess.run(None, {"x": x})[0]
                want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
                np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-3)   # sums of 1024 products
                [segment] = sess._lease.segments
                assert segment.startswith(str(shm))
                smaps = Path("/proc/self/smaps").read_text()
                mapping = smaps[smaps.index(segment):].split("VmFlags")[0]
                huge_kib = int(mapping.split("ShmemPmdMapped:")[1].split()[0])
                assert huge_kib >= 2048, mapping
    finally:
        stop_cleanly(d)
