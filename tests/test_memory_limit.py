"""The daemon inside a real memory cgroup (issue 42), as systemd's MemoryMax=, a container or a pod runs it: the
host tier sized from the cgroup's limit, loads past it refused with a typed error, idle models given back to a
process that grows beside it, a crash and restart inside the limit. Skipped, with one line, where no memory
cgroup can be made (not root, no memory controller)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import onnx
import pytest

from conftest import DaemonProcess, stop_cleanly, wait_until
from modelcache import memlimit, zoo
from modelcache.errors import OutOfMemoryError
from modelcache.store.packing import pack

MiB = 1 << 20
MODEL_BYTES = 48 * MiB
MODELS = 6


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    """MODELS packed models of MODEL_BYTES each, sharing no tensor, in one repository the tests' daemons use."""
    root = tmp_path_factory.mktemp("memrepo")
    for i in range(MODELS):
        src = root / f"m{i}.onnx"
        onnx.save(zoo.sized(MODEL_BYTES, seed=i), str(src))
        pack(str(src), root / "repo", f"m{i}", 1)
        src.unlink()
    return root / "repo"


@pytest.fixture
def cgroup(tmp_path):
    """cgroup(limit_bytes) -> a memory cgroup of that limit below this process's; removed after the test."""
    made = []

    def make(limit_bytes: int) -> memlimit.ChildCgroup:
        cg = memlimit.ChildCgroup.make(f"mc-test-{os.getpid()}-{len(made)}-{tmp_path.name[-12:]}", limit_bytes)
        if cg is None:
            pytest.skip(f"no memory cgroup for this test: {memlimit.ChildCgroup.why}")
        made.append(cg)
        return cg

    yield make
    for cg in made:
        cg.remove()


def daemon_in(cg, root, repository, **settings) -> DaemonProcess:
    env = {"MODELCACHE_REPOSITORY": str(repository), "MODELCACHE_LOG_LEVEL": "info",
           **{f"MODELCACHE_{k.upper()}": str(v) for k, v in settings.items()}}
    d = DaemonProcess(root, env)
    d.preexec = cg.enter
    return d


def host_tier(client) -> dict:
    return client.stats().tiers[0]


def test_the_host_tier_is_sized_from_the_cgroups_limit_and_a_larger_one_refused(tmp_path, cgroup, repository):
    cg = cgroup(512 * MiB)
    conf = tmp_path / "modelcache.toml"
    conf.write_text("")
    d = daemon_in(cg, tmp_path, repository, config=conf).start()
    try:
        with d.client() as c:
            host = host_tier(c)
        assert host["memory_limit_bytes"] == 512 * MiB and "cgroup" in host["memory_limit_source"]
        assert host["capacity_bytes"] == 256 * MiB               # the default 50 %: of the limit, not of RAM
        assert host["memory_reserve_bytes"] == 128 * MiB         # auto: a tenth, at least 256M, at most a quarter
        assert 0 < host["headroom_bytes"] < 512 * MiB - 20 * MiB  # (the daemon itself is in there)
        r = subprocess.run([sys.executable, "-m", "modelcache.cli", "status"], env=d.env, capture_output=True,
                           text=True)
        assert "memory: limit 512.0 MiB (cgroup" in r.stdout, r.stdout
        # A reload reads the limit again (the pod resized) and checks a new capacity against it first.
        (cg.path / ("memory.limit_in_bytes" if cg.version == 1 else "memory.max")).write_text(str(768 * MiB))
        conf.write_text('host_capacity = "700M"\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reload failed, keeping the old settings" in d.log_path.read_text(), what="a refusal")
        conf.write_text('host_capacity = "60%"\n')
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "reloaded settings: host_capacity applied" in d.log_path.read_text(), what="a reload")
        with d.client() as c:
            host = host_tier(c)
        assert host["memory_limit_bytes"] == 768 * MiB and host["capacity_bytes"] == int(0.6 * 768 * MiB)
    finally:
        stop_cleanly(d)
    # A capacity the limit cannot hold is refused at start, in one line that says what to do.
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "daemon"], capture_output=True, text=True,
                       env={**d.env, "MODELCACHE_HOST_CAPACITY": "1G", "MODELCACHE_CONFIG": ""}, preexec_fn=cg.enter,
                       timeout=60)
    assert r.returncode != 0 and not r.stdout.startswith("READY")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "host_capacity 1G (1024 MiB) is more than the memory limit allows" in lines[0] \
        and "capacity_over_limit" in lines[0], r.stderr
    # ... or, asked for, run with a warning.
    d = daemon_in(cg, tmp_path, repository, host_capacity="1G", capacity_over_limit="warn").start()
    try:
        with d.client() as c:
            assert host_tier(c)["capacity_bytes"] == 1 << 30
        assert "running over it as capacity_over_limit = warn says" in d.log_path.read_text()
    finally:
        stop_cleanly(d)


def test_loads_past_the_limit_fail_typed_and_the_daemon_lives(tmp_path, cgroup, repository):
    """A tier allowed past the limit (warn) fills with models in use: the next load is an OutOfMemoryError naming
    what holds the memory, never an OOM kill; once a session closes, the same load gives that model back."""
    cg = cgroup(320 * MiB)
    d = daemon_in(cg, tmp_path, repository, host_capacity="300M", capacity_over_limit="warn",
                  memory_reserve="64M", open_when_full="wait").start()
    try:
        with d.client() as c:
            leases, refused = [], None
            for i in range(MODELS):
                try:
                    leases.append(c.open(f"m{i}"))
                except OutOfMemoryError as e:
                    refused = (i, str(e))
                    break
            assert refused is not None, "every model fit: the limit did not bind"
            i, message = refused
            assert len(leases) >= 2 and f"m{i}@1 needs 48 MiB in the host tier" in message, message
            assert "in use by 1 session" in message and "memory_reserve 64 MiB" in message, message
            assert d.proc.poll() is None and cg.oom_kills() == 0
            c.release(leases[0].lease_id)
            c.load(f"m{i}")                                  # m0, idle now, is given back for it
            listed = {m["name"]: m for m in c.list()}
            assert listed["m0"]["tier"] == "disk" and listed[f"m{i}"]["tier"] == "host"
            assert c.stats().counters["pressure_evictions"] >= 1
            for lease in leases[1:]:
                c.release(lease.lease_id)
        assert cg.oom_kills() == 0
    finally:
        stop_cleanly(d)


def test_opens_past_the_limit_map_the_repositorys_files(tmp_path, cgroup, repository):
    """open_when_full = disk (the default): where the memory limit cannot take another model in use, its open is
    answered at once with a lease over its packed files in the repository, not refused; nobody is OOM-killed."""
    cg = cgroup(320 * MiB)
    d = daemon_in(cg, tmp_path, repository, host_capacity="300M", capacity_over_limit="warn",
                  memory_reserve="64M").start()
    try:
        with d.client() as c:
            leases = [c.open(f"m{i}") for i in range(MODELS)]
            from_disk = [lease for lease in leases if lease.segments[0].startswith(str(repository))]
            assert 1 <= len(from_disk) < MODELS and c.stats().counters["opens_from_disk"] == len(from_disk)
            assert all(lease.segments == [str(repository / lease.name / "1" / "weights.bin")] for lease in from_disk)
            listed = {m["name"]: m for m in c.list()}
            assert all(listed[lease.name]["tier"] == "disk" for lease in from_disk)
            assert d.proc.poll() is None and cg.oom_kills() == 0
            for lease in leases:
                c.release(lease.lease_id)
        assert cg.oom_kills() == 0
    finally:
        stop_cleanly(d)


def test_idle_models_are_given_back_to_a_process_growing_beside_the_daemon(tmp_path, cgroup, repository):
    """The tier holds idle models; a process in the same cgroup grows at 128 MiB/s past what is left: the daemon
    gives models back in time, the process gets all it asked for, nobody is OOM-killed."""
    cg = cgroup(640 * MiB)
    d = daemon_in(cg, tmp_path, repository).start()
    try:
        with d.client() as c:
            for i in range(5):
                c.load(f"m{i}")
            before = host_tier(c)
            assert before["used_bytes"] >= 5 * MODEL_BYTES
            wanted = before["headroom_bytes"] + 3 * MODEL_BYTES // 2   # more than is free: 2 models must go
            grower = cg.grow(wanted, 128 * MiB)
            try:
                assert grower.stdout.readline().startswith("held"), f"the growing process died: rc {grower.poll()}"
                assert cg.oom_kills() == 0 and d.proc.poll() is None
                after = host_tier(c)
                assert c.stats().counters["pressure_evictions"] >= 2
                assert after["used_bytes"] <= before["used_bytes"] - 2 * MODEL_BYTES
            finally:
                grower.kill()
                grower.wait()
            # What was given back comes back on demand.
            c.release(c.open("m0").lease_id)
        assert "memory pressure:" in d.log_path.read_text()
    finally:
        stop_cleanly(d)


def test_a_restart_inside_the_limit_gives_back_before_it_serves(tmp_path, cgroup, repository):
    """A daemon killed with its tier full leaves that tier charged to the cgroup; something else now holds memory
    there too. The restarted daemon re-adopts the tier, gives back idle models until the reserve is free, and
    serves: no OOM kill, no loop."""
    cg = cgroup(640 * MiB)
    d = daemon_in(cg, tmp_path, repository, memory_reserve="96M").start()
    daemon_bytes = memlimit.working_set_bytes(cg.limit)     # the daemon alone, tier empty
    with d.client() as c:
        for i in range(5):
            c.load(f"m{i}")
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    # Leave the restarted daemon about 40 MiB: room to start, less than its 96 MiB reserve.
    ballast = cg.grow(memlimit.headroom_bytes(cg.limit) - daemon_bytes - 40 * MiB, 1 << 40)
    try:
        assert ballast.stdout.readline().startswith("held")
        d2 = daemon_in(cg, tmp_path, repository, memory_reserve="96M").start()
        try:
            log = d2.log_path.read_text()
            assert "warm restart: re-adopted 5 models" in log and "memory pressure:" in log, log
            with d2.client() as c:
                host = host_tier(c)
                assert host["headroom_bytes"] >= host["memory_reserve_bytes"]
                assert c.stats().counters["pressure_evictions"] >= 1
                c.release(c.open("m4").lease_id)
            assert cg.oom_kills() == 0 and ballast.poll() is None
        finally:
            stop_cleanly(d2)
    finally:
        ballast.kill()
        ballast.wait()
        d.kill()
    wait_until(lambda: not d.shm_dir.exists(), what="the dead daemon's tier removed")
