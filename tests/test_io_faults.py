"""When the daemon's own disk fails: every I/O fault is one typed line, the service is kept, nothing is lost.

First the symptoms an outside test found, each on a real file system (a tmpfs mounted full or read-only,
a lock held by another process); then the campaign: ENOSPC and EIO injected at the Nth write, fsync,
rename, unlink, mkdir and open-for-writing under the repository, the state directory and the host tier,
N = 1, 2, ... until the operation completes without reaching N, during every operation that writes
(tests/iofault.py has the injector; docs/faults.md how to run the whole campaign).
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import iofault
from modelcache import zoo
from modelcache.errors import ModelCacheError, StorageError
from modelcache.tiers.disk import Repository
from conftest import DaemonProcess, dead_pid, stop_cleanly, wait_until


def fill(directory: Path) -> None:
    """Write into `directory` until its file system is full."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for chunk in (1 << 16, 1 << 12):
            try:
                while True:
                    os.write(fd, b"\0" * chunk)
            except OSError:
                pass
    finally:
        os.close(fd)


def daemon_over(root: Path, repository: Path, env: dict | None = None) -> DaemonProcess:
    """A daemon (not started) whose repository is `repository` (a tmpfs, say) rather than root/repo."""
    d = DaemonProcess(root, env)
    d.repository = repository
    d.env["MODELCACHE_REPOSITORY"] = str(repository)
    return d


def outputs(c, name: str, feeds: dict, version: int | None = None) -> np.ndarray:
    out, _ = c.infer(name, feeds, version=version)
    return next(iter(out.values()))


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "internal error" not in text, text
    return text


# -- the symptoms ------------------------------------------------------------------------------------

def test_a_removal_that_fails_leaves_every_version_served(tmp_path, small_tmpfs, zoo_file):
    """A read-only repository: `rm` fails with one storage line naming the version and the repository, every
    version stays served with its outputs, and once the repository is writable again the same rm works."""
    src = zoo_file("tiny-cnn")
    feeds = zoo.sample_inputs(src)
    d = daemon_over(tmp_path, small_tmpfs("16m", "repo")).start()
    try:
        with d.client() as c:
            c.add(src, "m")
            c.add(src, "m")
            before = {v: outputs(c, "m", feeds, v) for v in (1, 2)}
            subprocess.run(["mount", "-o", "remount,ro", str(d.repository)], check=True)
            with pytest.raises(StorageError) as e:
                c.remove("m", 2)
            assert "read-only file system" in one_line(e.value) and "m@2" in str(e.value) \
                and str(d.repository) in str(e.value)
            for v in (1, 2):
                np.testing.assert_array_equal(outputs(c, "m", feeds, v), before[v])
            c.release(c.open("m", 2).lease_id)
            subprocess.run(["mount", "-o", "remount,rw", str(d.repository)], check=True)
            c.remove("m", 2)
            assert [m["version"] for m in c.list()] == [1]
            np.testing.assert_array_equal(outputs(c, "m", feeds, 1), before[1])
            assert not list(d.repository.glob(".tmp-*"))
    finally:
        stop_cleanly(d)


def test_a_full_state_directory_does_not_break_the_stop(tmp_path, small_tmpfs, zoo_file):
    """The performance models cannot be saved: the stop says so in one log line, exits 0, and removes its
    sockets and its host tier all the same."""
    state = small_tmpfs("64k", "state")
    src = zoo_file("tiny-cnn")
    d = DaemonProcess(tmp_path, {"MODELCACHE_STATE_DIR": str(state), "MODELCACHE_WORKERS": "1"}).start()
    with d.client() as c:
        c.add(src, "m")
        outputs(c, "m", zoo.sample_inputs(src))      # the engine has timings to save now
    fill(state)
    lane = Path(d.socket[len("ipc://"):] + ".lane")
    assert lane.exists()
    stop_cleanly(d)          # exit 0, no socket, no host tier
    assert not lane.exists()
    log = d.log_path.read_text()
    said = [line for line in log.splitlines() if "perfmodels.json" in line]
    assert len(said) == 1 and "no space left on device" in said[0], log
    assert "internal error" not in log and "Traceback" not in log
    assert sorted(p.name for p in state.iterdir()) == ["filler"], "a half-written state file stayed"


def test_a_state_file_that_cannot_be_written_is_said_once_and_saved_later(small_tmpfs, caplog):
    """storage.StateFile (the performance models): failures on a full or read-only state directory are one
    warning naming the file, however many saves fail; the first save that works again says so."""
    from modelcache.storage import StateFile
    state = small_tmpfs("64k", "state")
    saved = StateFile(state / "perfmodels.json", "the performance models")
    assert saved.save("{}")
    fill(state)
    with caplog.at_level("INFO", logger="modelcache.storage"):
        assert not saved.save("{" + '"k": [1.0],' * 4000 + '"z": []}')
        assert not saved.save("{" + '"k": [1.0],' * 4000 + '"z": []}')
        assert (state / "perfmodels.json").read_text() == "{}"      # the last good one, whole
        assert sorted(p.name for p in state.iterdir()) == ["filler", "perfmodels.json"]
        (state / "filler").unlink()
        assert saved.save('{"k": [1.0]}')
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "no space left on device" in lines[0] and "perfmodels.json" in lines[0] \
        and "saved again" in lines[1], lines


def test_enospc_while_storing_a_batching_profile_is_a_storage_error(tmp_path, small_tmpfs, zoo_file):
    """`calibrate` stores its profile in the manifest: a full repository refuses it in one storage line, the
    model keeps its old profile (in memory and on disk), and once there is room the same store works."""
    from modelcache.client.calibrate import calibrate
    src = zoo_file("tiny-cnn")
    d = daemon_over(tmp_path, small_tmpfs("4m", "repo"),
                    {"MODELCACHE_WORKERS": "1", "MODELCACHE_STATE_DIR": str(tmp_path / "state")}).start()
    try:
        with d.client() as c:
            c.add(src, "m")
            manifest = d.repository / "m" / "1" / "manifest.json"
            stored = manifest.read_bytes()
            fill(d.repository)
            with pytest.raises(StorageError) as e:
                calibrate(c, "m", batches=[1, 2], runs=1)
            assert "no space left on device" in one_line(e.value) and "m@1" in str(e.value) \
                and str(manifest.parent) in str(e.value)
            assert manifest.read_bytes() == stored
            assert not [p.name for p in manifest.parent.iterdir() if p.name.endswith(".tmp")]
            assert c.describe("m").stages == [] and "n_opt" not in str(c.stats().models)
            (d.repository / "filler").unlink()
            profile = calibrate(c, "m", batches=[1, 2], runs=1)
            assert manifest.read_bytes() != stored and str(profile["n_opt"]) in manifest.read_text()
    finally:
        stop_cleanly(d)


def test_a_start_that_waits_on_the_repository_lock_says_who_holds_it(tmp_path):
    """Another process holds <repository>/.lock: the starting daemon says at once, and again every few
    seconds, which process holds it and since when, and comes up as soon as it is let go."""
    d = DaemonProcess(tmp_path)
    d.repository.mkdir(parents=True)
    fd = os.open(d.repository / ".lock", os.O_RDWR | os.O_CREAT, 0o640)
    fcntl.flock(fd, fcntl.LOCK_EX)
    started: list = []
    starter = threading.Thread(target=lambda: started.append(d.start(timeout_s=60)))
    try:
        try:
            starter.start()
            said = f"held by pid {os.getpid()}"
            wait_until(lambda: d.log_path.exists() and said in d.log_path.read_text(), 10, "the first line on the lock")
            t0 = time.monotonic()
            wait_until(lambda: d.log_path.read_text().count(said) >= 2, 15, "the lock's holder said again")
            assert time.monotonic() - t0 < 10
            assert str(d.repository / ".lock") in d.log_path.read_text()
            assert not started
        finally:
            os.close(fd)
            starter.join(60)
        assert started, d.log_path.read_text()
        stop_cleanly(d)
    finally:
        d.kill()            # (a failure above must not leave the daemon, which starts once the lock is let go)
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "daemon", "--help"], capture_output=True, text=True)
    assert "waits up to" in " ".join(r.stdout.split()) and "repository" in r.stdout, r.stdout


def test_garbage_left_by_others_is_swept_or_refused_in_one_line(tmp_path, zoo_file):
    """A plain file where a temp dir would be, a directory where the repository lock would be, a file where a
    host tier would be: the start sweeps what it may and comes up; what stands in an add's way refuses it in
    one line naming the file."""
    d = DaemonProcess(tmp_path, {"MODELCACHE_SHM_DIR": str(tmp_path / "shm")})
    (tmp_path / "shm").mkdir()
    d.repository.mkdir(parents=True)
    (d.repository / ".tmp-m@1-garbage").write_bytes(os.urandom(100))
    (d.repository / ".lock").mkdir()
    dead_tier = tmp_path / "shm" / f"modelcache.{os.getuid()}.{dead_pid()}"
    dead_tier.write_bytes(os.urandom(100))
    d.start()
    try:
        assert (d.repository / ".tmp-m@1-garbage").exists()    # (swept once the lock can be had: below)
        assert not dead_tier.exists()
        with d.client() as c:
            with pytest.raises(StorageError) as e:
                c.add(zoo_file("tiny-cnn"), "m")
            assert str(d.repository / ".lock") in one_line(e.value) and "adding m" in str(e.value)
            (d.repository / ".lock").rmdir()
            c.add(zoo_file("tiny-cnn"), "m")
            assert not (d.repository / ".tmp-m@1-garbage").exists()
    finally:
        stop_cleanly(d)
    log = d.log_path.read_text()
    assert "Traceback" not in log and "internal error" not in log
    assert str(d.repository / ".lock") in log and str(dead_tier) in log


def test_a_full_dev_shm_under_a_clients_inputs_is_a_storage_error(small_tmpfs):
    """A serve request's big input goes through a file in /dev/shm: when it cannot be written, the client gets
    a StorageError naming the input, the model and the file, and none of the call's files stays."""
    from modelcache.wire import tensors
    shm = small_tmpfs("1m", "shm")
    feeds = {"a": np.ones(100_000, np.float32), "b": np.ones(400_000, np.float32)}   # 0.4 MB fits, 1.6 MB not
    with pytest.raises(StorageError) as e:
        tensors.encode(feeds, shm_dir=str(shm), model="m")
    assert "no space left on device: passing input 'b' of m" in one_line(e.value) and str(shm) in str(e.value)
    assert list(shm.iterdir()) == []


# -- the campaign ------------------------------------------------------------------------------------
#
# For each operation and each errno, N = 1, 2, ...: arm the injector to fail the Nth write, fsync, rename,
# unlink, mkdir or open-for-writing under the campaign's directories, run the operation once, disarm, and
# check the invariants; stop at the first N the operation completes without reaching. The default run keeps
# a slice (a few N of each operation, the errnos alternating); MODELCACHE_IO_FAULTS=all runs every N with
# both errnos (docs/faults.md). MODELCACHE_IO_FAULTS_REPORT=FILE appends one JSON line per operation.

FULL = os.environ.get("MODELCACHE_IO_FAULTS") == "all"
ERRNOS = (errno.ENOSPC, errno.EIO)
SLICE_N = (1, 2, 5, 11)         # the slice's N: the first calls, and a few further in (ends earlier if done)


@pytest.fixture(scope="session")
def injector_library(tmp_path_factory):
    so = iofault.build(tmp_path_factory.mktemp("iofault"))
    if so is None:
        pytest.skip("no C compiler to build the I/O fault injector (tests/iofault/iofault.c)")
    return so


class Campaign:
    """One operation's campaign: its directories (all watched by the injector), a daemon whose calls may fail,
    a baseline model served before every fault whose outputs must never change, and the trials' record."""

    def __init__(self, root: Path, library: Path, name: str):
        self.root, self.name = root, name
        self.repo, self.state, self.offline, self.remote = (root / d for d in ("repo", "state", "offline", "remote"))
        self.run_dir = root / "run"
        self.shm = Path("/dev/shm") / f"mc-iof-{os.getpid()}-{root.name}"
        for d in (self.repo, self.state, self.offline, self.remote, self.run_dir, self.shm):
            d.mkdir(parents=True, exist_ok=True)
        self.faults = iofault.Injector(library, root / "faults.ctl",
                                       [self.repo, self.state, self.shm, self.offline, self.remote, self.run_dir])
        self.env = {"MODELCACHE_SHM_DIR": str(self.shm), "MODELCACHE_STATE_DIR": str(self.state),
                    "MODELCACHE_WORKERS": "1", "MODELCACHE_REMOTE": self.remote.as_uri(), **self.faults.env}
        self.daemon: DaemonProcess | None = None
        self.trials: list = []      # (operation, errno name, N, what failed, the error's line or "absorbed")
        self.seconds: dict = {}     # operation -> seconds its sweep took

    # -- the daemon, and what it serves -----------------------------------------------------------------
    def start(self) -> DaemonProcess:
        self.daemon = daemon_over(self.root, self.repo, self.env)
        return self.daemon.start()

    def stop(self) -> None:
        if self.daemon is not None:
            self.faults.disarm()
            stop_cleanly(self.daemon)
            self.daemon = None

    def baseline(self, c, src: str) -> None:
        """Add the model every trial checks, and remember its outputs."""
        self.feeds = zoo.sample_inputs(src)
        c.add(src, "base")
        self.expected = outputs(c, "base", self.feeds)

    def check_served(self, c) -> None:
        np.testing.assert_array_equal(outputs(c, "base", self.feeds), self.expected)
        c.release(c.open("base").lease_id)

    # -- the directories ---------------------------------------------------------------------------------
    def files(self) -> set:
        """Every path in the watched directories, but for the repository lock (whose holders rewrite it) and
        the performance models (saved every few minutes: the stop campaign checks them)."""
        found = set()
        for top in (self.repo, self.state, self.shm, self.offline, self.remote, self.run_dir):
            for dirpath, dirnames, filenames in os.walk(top):
                found.update(os.path.join(dirpath, n) for n in dirnames + filenames)
        return found - {str(self.repo / ".lock"), str(self.offline / ".lock"), str(self.state / "perfmodels.json")}

    # -- one operation, every N --------------------------------------------------------------------------
    def sweep(self, setup, run, failed, succeeded, undo=lambda: None, errnos=ERRNOS, may_go=(),
              may_stay=lambda error: (), label: str = "") -> None:
        """For each errno and N: setup(); arm; run() -> result, or a typed error; disarm; then failed(error,
        before) or succeeded(result) checks what is left; a failed run is run again without the fault (it must
        succeed, no restart); undo() brings things back for the next N. A failed run leaves every path as it
        was, except that paths under `may_go` may have been tidied away, and those under may_stay(error) (what
        a finished first part of the operation made) may be new."""
        t0 = time.monotonic()
        for k, err in enumerate(errnos):
            ns = itertools.count(1) if FULL else [n for i, n in enumerate(SLICE_N) if (i + k) % 2 == 0]
            for n in ns:
                setup()
                before = self.files()
                self.faults.arm(n, err)
                try:
                    result, error = run(), None
                except ModelCacheError as e:
                    result, error = None, e
                finally:
                    self.faults.disarm()
                fired, what = self.faults.fired, self.faults.what
                assert self.daemon is None or self.daemon.proc.poll() is None, \
                    f"the daemon died at {what}:\n{self.daemon.log_path.read_text()[-3000:]}"
                if error is not None:
                    assert fired, f"failed with no fault injected: {error}"
                    context = f"{errno.errorcode[err]} at call {n} ({what})"
                    text = str(error)
                    assert "\n" not in text and "internal error" not in text, f"{context}: {text}"
                    assert type(error) is not ModelCacheError, f"{context}: untyped: {text}"
                    assert "/" in text, f"{context}: names no path: {text}"
                    after = self.files()        # (before failed() looks: serving a model promotes it)
                    failed(error, before, context)
                    gone = {p for p in before - after if not any(p.startswith(str(d)) for d in may_go)}
                    left = {p for p in after - before if not any(p.startswith(str(d)) for d in may_stay(error))}
                    assert not left and not gone, f"{context}: left {sorted(left)}, took {sorted(gone)}"
                    result = run()          # the fault is gone: the same operation works, with no restart
                self.trials.append((label or self.name, errno.errorcode[err], n, what if fired else "",
                                    str(error) if error is not None else ("absorbed" if fired else "done")))
                succeeded(result)
                undo()
                if not fired:
                    break
        self.seconds[label or self.name] = round(time.monotonic() - t0, 1)

    def report(self) -> list:
        """Per operation: trials, faults injected (typed failures, and faults the operation absorbed: a
        removal tried again, a lock's note), the largest N per errno, the kinds of call hit, seconds."""
        out = []
        for label in dict.fromkeys(t[0] for t in self.trials):
            trials = [t for t in self.trials if t[0] == label]
            out.append({"operation": label, "trials": len(trials), "faults": sum(1 for t in trials if t[3]),
                        "failed_typed": sum(1 for t in trials if t[3] and t[4] not in ("absorbed", "done")),
                        "absorbed": sum(1 for t in trials if t[4] == "absorbed"),
                        "max_n": {e: max((t[2] for t in trials if t[1] == e and t[3]), default=0)
                                  for e in dict.fromkeys(t[1] for t in trials)},
                        "calls": sorted({t[3].split()[0] for t in trials if t[3]}),
                        "seconds": self.seconds.get(label, 0.0), "full": FULL})
        path = os.environ.get("MODELCACHE_IO_FAULTS_REPORT")
        if path:
            with open(path, "a") as f:
                f.writelines(json.dumps(line) + "\n" for line in out)
        return out

    def close(self) -> None:
        self.faults.disarm()
        if self.daemon is not None:
            self.daemon.kill()
        self.faults.close()
        left = list(self.shm.iterdir()) if self.shm.exists() else []
        shutil.rmtree(self.shm, ignore_errors=True)
        assert not left, f"left behind in shm: {left}"


@pytest.fixture
def campaign(request, tmp_path, injector_library):
    c = Campaign(tmp_path, injector_library, request.node.name)
    yield c
    try:
        for line in c.report():
            print(json.dumps(line))
    finally:
        c.close()


def served_versions(c, name: str) -> list:
    return sorted(m["version"] for m in c.list() if m["name"] == name)


def test_campaign_add_through_the_daemon(campaign, zoo_file):
    src = zoo_file("tiny-cnn")
    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, src)
        added = {}

        def failed(error, before, context):
            assert "new" in str(error), f"{context}: names no model: {error}"
            assert served_versions(c, "new") == [], context
            campaign.check_served(c)

        def succeeded(reply):
            added["v"] = reply.version
            assert served_versions(c, "new") == [reply.version]
            np.testing.assert_array_equal(outputs(c, "new", campaign.feeds), campaign.expected)

        campaign.sweep(lambda: None, lambda: c.add(src, "new"), failed, succeeded,
                       undo=lambda: c.remove("new", added["v"]), label="add, through the daemon")
        campaign.check_served(c)
    campaign.stop()


class CommandFailed(ModelCacheError):
    """A command that failed with one typed line (one_line_refusal checked it): its line, for the campaign."""


def cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelcache.cli", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def one_line_refusal(r: subprocess.CompletedProcess, context: str) -> str:
    """A command that failed: exit 1 and one `modelcache: ...` line on stderr, typed (no internal error)."""
    assert r.returncode == 1, f"{context}: exit {r.returncode}: {r.stderr[-2000:]}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelcache: ") and "internal error" not in lines[0], \
        f"{context}: {r.stderr[-2000:]}"
    return lines[0]


def test_campaign_add_offline(campaign, zoo_file):
    """`modelcache add` with no daemon: the command packs into the repository itself."""
    src = zoo_file("tiny-cnn")
    env = {**os.environ, "MODELCACHE_CONFIG": "", "MODELCACHE_REPOSITORY": str(campaign.offline),
           "MODELCACHE_SOCKET": f"ipc://{campaign.root}/no-daemon.sock", **campaign.faults.env}

    def run():
        r = cli(env, "add", src, "--name", "off")
        if r.returncode != 0:
            raise CommandFailed(one_line_refusal(r, "add offline"))
        return r

    def failed(error, before, context):
        assert "off" in str(error) and str(campaign.offline) in str(error), f"{context}: {error}"

    def succeeded(r):
        assert [(m.name, m.version) for _, m in Repository(campaign.offline).scan()] == [("off", 1)]

    campaign.sweep(lambda: None, run, failed, succeeded, undo=lambda: shutil.rmtree(campaign.offline / "off"),
                   label="add, offline")


def test_campaign_promotion(campaign, zoo_file):
    """disk -> host: the copy into /dev/shm, the skeletons, the record a restart re-adopts."""
    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, zoo_file("tiny-cnn"))
        c.add(zoo_file("tiny-vit"), "prom")       # (no tensor in common with base: its promotion copies them all)
        vit = zoo.sample_inputs(zoo_file("tiny-vit"))
        want = outputs(c, "prom", vit)

        def failed(error, before, context):
            assert "prom@1" in str(error) and str(campaign.shm) in str(error), f"{context}: {error}"
            assert {m["name"]: m["tier"] for m in c.list()}["prom"] == "disk", context
            campaign.check_served(c)

        def succeeded(_):
            assert {m["name"]: m["tier"] for m in c.list()}["prom"] == "host"
            np.testing.assert_array_equal(outputs(c, "prom", vit), want)

        campaign.sweep(lambda: c.evict("prom"), lambda: c.load("prom"), failed, succeeded, label="promotion")
        campaign.check_served(c)
    campaign.stop()


def test_campaign_remove(campaign, zoo_file):
    src = zoo_file("tiny-cnn")
    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, src)
        c.add(src, "gone")
        added = {}

        def setup():
            added["v"] = c.add(src, "gone").version

        def failed(error, before, context):
            assert f"gone@{added['v']}" in str(error) and str(campaign.repo) in str(error), f"{context}: {error}"
            assert served_versions(c, "gone") == [1, added["v"]], context    # every version still served
            for v in (1, added["v"]):
                np.testing.assert_array_equal(outputs(c, "gone", campaign.feeds, v), campaign.expected)

        def succeeded(_):
            assert served_versions(c, "gone") == [1]
            assert not (campaign.repo / "gone" / str(added["v"])).exists()

        campaign.sweep(setup, lambda: c.remove("gone", added["v"]), failed, succeeded, label="rm")
        campaign.check_served(c)
    campaign.stop()


def test_campaign_publish_and_fetch(campaign, zoo_file):
    """`modelcache publish` writing a store's index, then the daemon fetching from it on a miss."""
    from modelcache.store.packing import pack
    pack(zoo_file("tiny-if"), campaign.remote, "far", 1)
    env = {**os.environ, "MODELCACHE_CONFIG": "", **campaign.faults.env}
    index = campaign.remote / "index.json"

    def publish():
        r = cli(env, "publish", str(campaign.remote))
        if r.returncode != 0:
            raise CommandFailed(one_line_refusal(r, "publish"))
        return r

    def published_failed(error, before, context):
        assert str(campaign.remote) in str(error), f"{context}: {error}"
        assert not index.exists() or json.loads(index.read_text())["models"], context

    campaign.sweep(lambda: None, publish, published_failed,
                   lambda r: json.loads(index.read_text())["models"][0]["name"] == "far", label="publish")

    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, zoo_file("tiny-cnn"))
        feeds = zoo.sample_inputs(zoo_file("tiny-if"))

        def fetched(error) -> tuple:
            """A fetch that completed before its promotion failed: the version stays, whole, on disk."""
            return (campaign.repo / "far",) if "promoting far@1" in str(error) else ()

        def failed(error, before, context):
            assert "far" in str(error) and "/" in str(error), f"{context}: {error}"
            if fetched(error):
                assert [(m["version"], m["tier"]) for m in c.list() if m["name"] == "far"] == [(1, "disk")], context
                assert [r["status"] for r in c.verify("far").reports] == ["ok"], context
            else:
                assert served_versions(c, "far") == [], context
            campaign.check_served(c)

        def succeeded(_):
            assert served_versions(c, "far") == [1]
            outputs(c, "far", feeds)

        campaign.sweep(lambda: None, lambda: c.load("far"), failed, succeeded, undo=lambda: c.remove("far", 1),
                       may_stay=fetched, label="remote fetch (and its promotion)")
        campaign.check_served(c)
    campaign.stop()


def test_campaign_partition_and_calibrate(campaign, zoo_file):
    """Both rewrite a model's stored files in place (stage skeletons, the manifest): all or nothing."""
    from modelcache.client.calibrate import calibrate
    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, zoo_file("tiny-cnn"))
        manifest = campaign.repo / "base" / "1" / "manifest.json"

        def failed(error, before, context, stages=0):
            assert "base@1" in str(error) and str(campaign.repo) in str(error), f"{context}: {error}"
            assert manifest.read_bytes() == stored["manifest"], context
            assert len(c.describe("base").stages) == stages, context
            campaign.check_served(c)

        def remember():
            stored["manifest"] = manifest.read_bytes()
        stored: dict = {}
        campaign.sweep(remember, lambda: c.partition("base", stages=2), failed,
                       lambda stages: (len(stages) == 2 and campaign.check_served(c)),
                       undo=lambda: c.partition("base", stages=1), label="partition")
        c.partition("base", stages=2)
        campaign.sweep(remember, lambda: calibrate(c, "base", batches=[1, 2], runs=1),
                       lambda e, b, ctx: failed(e, b, ctx, stages=2),
                       lambda profile: str(profile["n_opt"]) in manifest.read_text(), label="calibrate")
        campaign.check_served(c)
    campaign.stop()


def test_campaign_stop_and_its_state_saves(campaign, zoo_file):
    """SIGTERM: the performance models saved (or said, once, not to be), and the sockets and the host tier
    removed whatever failed; exit 0."""
    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, zoo_file("tiny-cnn"))
    campaign.stop()
    perf = campaign.state / "perfmodels.json"

    def setup():
        campaign.start()
        with campaign.daemon.client() as c:
            campaign.check_served(c)           # (timings to save)

    def stop():
        d, campaign.daemon = campaign.daemon, None
        tier = d.shm_dir
        rc = d.stop()
        return d, tier, rc

    def stopped(result):
        d, tier, rc = result
        log = d.log_path.read_text()
        assert rc == 0, log[-3000:]
        assert not tier.exists(), f"the host tier stayed: {list(tier.iterdir())}"
        for sock in (Path(d.socket[len("ipc://"):]), Path(d.socket[len("ipc://"):] + ".lane")):
            assert not sock.exists(), f"{sock} stayed"
        assert "Traceback" not in log and "internal error" not in log, log[-3000:]
        assert not list(campaign.state.glob("*.tmp")), "a half-written state file stayed"
        if perf.exists():
            json.loads(perf.read_text())
        if "perfmodels.json" in log.split("stopping:")[-1]:    # not saved: said once, and saved by the next stop
            assert log.split("stopping:")[-1].count("perfmodels.json") == 1, log[-3000:]
            setup()
            stopped(stop())
            assert "base@1" in perf.read_text()
        d.log_path.write_text("")

    campaign.sweep(setup, stop, lambda *a: None, stopped, label="stop (state saves, sockets, tier)")


def test_campaign_restart_readopts_or_refuses_in_one_line(campaign, zoo_file):
    """A start where a daemon died (SIGKILL): its host tier re-adopted, or the start refused in one line naming
    the file; either way nothing of it stays, and the next start serves the same outputs."""
    campaign.start()
    with campaign.daemon.client() as c:
        campaign.baseline(c, zoo_file("tiny-cnn"))
    campaign.stop()

    def setup():
        campaign.start()
        with campaign.daemon.client() as c:
            c.open("base")
        campaign.daemon.proc.kill()           # a crash: its host tier stays for the next start
        campaign.daemon.proc.wait()
        campaign.daemon.log.close()
        campaign.daemon = None

    def start():
        d = daemon_over(campaign.root, campaign.repo, campaign.env)
        try:
            d.start()
        except RuntimeError:
            line = d.log_path.read_text().strip().splitlines()[-1]
            d.kill()
            assert line.startswith("modelcache: ") and "internal error" not in line, line
            raise CommandFailed(line) from None
        campaign.daemon = d
        return d

    def refused(error, before, context):
        assert "/" in str(error), f"{context}: names no file: {error}"

    def started(d):
        with d.client() as c:
            campaign.check_served(c)
        campaign.stop()

    campaign.sweep(setup, start, refused, started, may_go=(campaign.shm, campaign.run_dir),
                   label="start re-adopting a dead daemon's tier")
