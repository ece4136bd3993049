"""Protocol fuzzing of a running daemon's two sockets, and the long run as a command.

    modelcache bench fuzz [--messages 40000] [--seed 0] [--batch 200] [--out DIR]

Starts a private daemon (its own socket, repository and log in a temporary directory), adds
tiny-cnn twice ("cnn" for the health probe, "fuzz" for the fuzz to name), then sends
--messages malformed messages from modelcache.bench.fuzz_messages, half on the ZeroMQ
ROUTER socket and half on the serve lane, in batches. After every batch a real client must
get a correct answer (compared with plain ORT) within --hang-s, or the run counts a hang.
Also sent, once each, on both sockets where they fit: a hello with pid 2**31, an infer whose
shm input is a FIFO, a 50 MB msgpack array of zeros, and a partition into 10**7 stages.

Printed: messages sent, replies (errors by code), crashes, hangs, internal errors (a request
that reached code outside the daemon's per-request checks), daemon RSS: peak above the baseline
against the largest message sent, and after the run against the baseline.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import stat
import tempfile
import time
from collections import Counter
from pathlib import Path
from ..usage import Parser

MiB = 1 << 20
SENTINEL_BASE = 2**62   # request ids of the fuzzer's own "list" markers; the fuzz never sends these


class Hang(AssertionError):
    """The daemon did not answer in time: the owner loop is stuck, or a reply was lost."""


class Crash(AssertionError):
    """The daemon process is gone."""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes(pid: int) -> int:
    """The process's resident high-water mark since reset_peak_rss."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak_rss(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


class Fuzzer:
    """Sends malformed messages to one daemon, checks every reply, and probes that it still serves.

    Properties checked (each a counted failure, and an exception where `strict`):
    every reply decodes; a reply is an ErrorReply, or the very reply its request kind is answered
    with; no ErrorReply says "internal"; the daemon lives; a real client's request gets the right
    answer within hang_s after every batch."""

    def __init__(self, address: str, daemon_pid: int, probe, target=None, hang_s: float = 10.0,
                 strict: bool = True):
        import zmq

        from ..wire.lane import lane_path
        from .fuzz_messages import FuzzTarget

        self.address, self.pid, self.probe_fn, self.hang_s, self.strict = address, daemon_pid, probe, hang_s, strict
        self.target = target or FuzzTarget()
        self.lane_path = lane_path(address)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.sent_kinds: dict[int, bytes] = {}    # req_id -> kind, for the requests a reply may answer
        self.next_id = 1
        self.sentinels = 0
        self.counts = Counter()                   # sent_zmq, sent_lane, replies, error:<code>, dropped, ...
        self.failures: list[str] = []
        self.largest_bytes = 0
        self.hello()

    def hello(self) -> None:
        """Become a client, so fuzzed requests that name the id get past the lease check to their handler
        (a fuzzed `bye` may drop it: a new one comes with every batch)."""
        from ..wire import protocol as P
        rid = self.next_id
        self.next_id += 1
        self.sock.send_multipart(P.encode(P.Hello(req_id=rid, protocol_version=P.PROTOCOL_VERSION, pid=os.getpid(),
                                                  client_name="fuzz")))
        if not self.sock.poll(int(self.hang_s * 1000)):
            raise Hang("no answer to hello")
        while True:
            reply = P.decode(self.sock.recv_multipart())
            if reply.req_id == rid:
                break
        self.target.client_ids = [*self.target.client_ids[-4:], reply.client_id]

    # -- checks --------------------------------------------------------------------------
    def fail(self, what: str, kind=AssertionError) -> None:
        self.failures.append(what)
        if self.strict:
            raise kind(what)

    def alive(self) -> None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            self.counts["crashes"] += 1
            self.fail(f"the daemon (pid {self.pid}) died", Crash)

    def check_reply(self, frames: list, sent_kind: bytes | None) -> None:
        from ..wire import protocol as P
        from .fuzz_messages import REPLY_TO
        self.counts["replies"] += 1
        try:
            reply = P.decode(frames)
        except Exception as e:
            return self.fail(f"a reply does not decode: {e}")
        if isinstance(reply, P.ErrorReply):
            self.counts["error:" + reply.code] += 1
            if reply.code == "internal":
                self.counts["internal_errors"] += 1
                self.fail(f"an internal error (input reached unchecked code): {reply.message[:300]}")
            return
        if sent_kind is not None and reply.KIND not in REPLY_TO.get(sent_kind, ()):
            self.fail(f"{sent_kind!r} answered with {reply.KIND!r}")
        self.counts["accepted:" + reply.KIND.decode()] += 1

    # -- ZeroMQ --------------------------------------------------------------------------
    def send_zmq_frames(self, frames: list, req_id: int | None, kind: bytes = b"") -> None:
        self.sock.send_multipart(frames)
        self.counts["sent_zmq"] += 1
        self.largest_bytes = max(self.largest_bytes, sum(len(f) for f in frames))
        if req_id is not None and kind:
            self.sent_kinds[req_id] = kind

    def zmq_batch(self, rng: random.Random, n: int) -> None:
        from .fuzz_messages import zmq_message
        for _ in range(n):
            m = zmq_message(rng, self.target, self.next_id)
            self.next_id += 1
            self.send_zmq_frames(m.frames, m.req_id, m.kind)
        self.settle_zmq()
        self.hello()

    def settle_zmq(self) -> None:
        """Send a marker request and read every reply up to its answer: the owner loop handled the batch.
        Replies of work handed to other threads (adds, loads, infers) may come later; they are checked
        whenever they come."""
        from ..wire import protocol as P
        marker = SENTINEL_BASE + self.sentinels
        self.sentinels += 1
        self.sock.send_multipart(P.encode(P.ListModels(req_id=marker)))
        deadline = time.monotonic() + self.hang_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not self.sock.poll(remaining_ms):
                self.alive()
                self.counts["hangs"] += 1
                return self.fail(f"no answer to a list request within {self.hang_s:g} s after a batch", Hang)
            frames = self.sock.recv_multipart()
            rid = P.req_id_of(frames)
            if rid == marker:
                return self.check_reply(frames, b"list")
            self.check_reply(frames, self.sent_kinds.pop(rid, None))

    # -- the lane ------------------------------------------------------------------------
    def lane_exchange(self, data: bytes, messages: list) -> None:
        """One connection: send `data`, half-close, and read replies until the daemon closes it."""
        from ..wire.lane import FrameReader, LaneError
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.hang_s)
        kinds = {m.req_id: m.kind for m in messages if m.req_id is not None}
        try:
            s.connect(self.lane_path)
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass    # the daemon refused the stream from its header, while the rest was on its way
            self.counts["sent_lane"] += 1
            self.largest_bytes = max(self.largest_bytes, len(data))
            reader = FrameReader()
            while True:
                try:
                    chunk = s.recv(1 << 20)
                except ConnectionResetError:
                    return
                except socket.timeout:
                    self.alive()
                    self.counts["hangs"] += 1
                    return self.fail(f"a lane connection got neither a reply nor its end within {self.hang_s:g} s",
                                     Hang)
                if not chunk:
                    return
                reader.feed(chunk)
                try:
                    while (message := reader.next()) is not None:
                        from ..wire import protocol as P
                        self.check_reply(list(message), kinds.get(P.req_id_of(list(message))))
                except LaneError as e:
                    return self.fail(f"the daemon's lane reply is not a frame: {e}")
        finally:
            s.close()

    def lane_batch(self, rng: random.Random, n: int) -> None:
        from .fuzz_messages import lane_bytes
        for _ in range(n):
            data, messages = lane_bytes(rng, self.target, self.next_id)
            self.next_id += 4
            self.lane_exchange(data, messages)

    # -- health --------------------------------------------------------------------------
    def probe(self) -> float:
        """A real client's request gets the right answer in time; returns its latency in ms."""
        self.alive()
        t0 = time.monotonic()
        try:
            ok = self.probe_fn()
        except Exception as e:
            self.alive()
            self.counts["hangs" if "did not answer" in str(e) else "probe_errors"] += 1
            return self.fail(f"the probe failed: {type(e).__name__}: {e}", Hang) or 0.0
        ms = (time.monotonic() - t0) * 1000
        if not ok:
            self.counts["wrong"] += 1
            self.fail("the probe got a wrong answer")
        if ms > self.hang_s * 1000:
            self.counts["hangs"] += 1
            self.fail(f"the probe took {ms:.0f} ms", Hang)
        self.counts["probes"] += 1
        return ms

    def close(self) -> None:
        self.sock.close()


# -- the four named cases of issue 15 ----------------------------------------------------

def named_cases(fz: Fuzzer, model: str) -> None:
    """Send each once, on each socket where it fits; fz checks the replies as any other."""
    from ..wire import protocol as P
    from ..wire.lane import frame
    from ..wire.tensors import IO_DIR, IO_PREFIX
    from .fuzz_messages import array_of

    rid = fz.next_id
    fz.next_id += 10
    fz.send_zmq_frames(P.encode(P.Hello(req_id=rid, protocol_version=P.PROTOCOL_VERSION, pid=2**31)), rid, b"hello")
    fifo = os.path.join(IO_DIR, f"{IO_PREFIX}fuzz-{os.getpid()}-fifo")
    os.mkfifo(fifo, 0o600)
    try:
        # A client id said hello just now: the fuzz's own messages may have said bye for the last one, or it
        # may have gone silent past lease_timeout_s, and the FIFO must meet the input check, not the client's.
        fz.hello()
        entry = {"name": "input", "dtype": "float32", "shape": [1, 3, 32, 32], "shm": fifo, "nbytes": 12288}
        infer = P.Infer(req_id=rid + 1, client_id=fz.target.client_ids[-1], name=model, inputs=[entry])
        fz.send_zmq_frames(P.encode(infer), rid + 1, b"infer")
        infer.req_id = rid + 2
        fz.lane_exchange(frame(*P.encode(infer)), [])
        fz.settle_zmq()
    finally:
        release_fifo(fifo)
    zeros = array_of(50_000_000)
    fz.send_zmq_frames([b"infer", zeros], 0, b"infer")
    fz.settle_zmq()      # one at a time: the bound is on the largest message, not on two at once
    fz.lane_exchange(frame(b"infer", zeros), [])
    del zeros
    fz.send_zmq_frames(P.encode(P.Partition(req_id=rid + 3, name=model, stages=10**7)), rid + 3, b"partition")
    fz.settle_zmq()


def release_fifo(path: str) -> None:
    """Unblock any reader stuck on the FIFO (it gets EOF), then remove it."""
    try:
        if stat.S_ISFIFO(os.lstat(path).st_mode):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
    Path(path).unlink(missing_ok=True)


# -- the command ---------------------------------------------------------------------------

def make_probe(client, name: str, src: str):
    """A health check: serve-mode infer on the lane and `list` on ZeroMQ, against plain ORT."""
    import numpy as np

    from .. import zoo
    from ..measure import plain_session
    feeds = zoo.sample_inputs(src, batch=2)
    want = plain_session(src).run(None, feeds)[0]

    def probe() -> bool:
        out = client.infer(name, feeds)[0]
        client.list()
        return bool(np.allclose(next(iter(out.values())), want, rtol=1e-4, atol=1e-5))
    return probe


def warm_up(client, model: str, src: str) -> None:
    """Do once each kind of work the fuzz may legitimately start on `model` (serve, partition and its
    undoing, evict and load), so the baseline holds the memory that work keeps for good (ORT's
    profiling session of a partition left 12 MiB of malloc arenas), and only growth is counted."""
    from .. import zoo
    feeds = zoo.sample_inputs(src)
    client.infer(model, feeds)
    client.partition(model, tail_fraction=0.3)
    client.infer(model, feeds)
    client.partition(model, stages=1)
    client.evict(model)
    client.load(model)
    client.infer(model, feeds)


def run_fuzz(messages: int, seed: int, batch: int, hang_s: float, work: Path, log=print) -> dict:
    from .. import zoo
    from ..client.connection import connect
    from ..measure import managed_daemon

    src = str(work / "tiny-cnn.onnx")
    zoo.save(zoo.build("tiny-cnn"), src)
    address = f"ipc://{work}/daemon.sock"
    rng = random.Random(seed)
    result = {"messages": messages, "seed": seed}
    with managed_daemon(address, str(work / "repo"), {"MODELCACHE_WORKERS": "1"}, str(work / "daemon.log")), \
            connect(address, timeout_s=hang_s) as client:
        client.add(src, "cnn")
        client.add(src, "fuzz")
        pid = client.stats().pid
        probe = make_probe(client, "cnn", src)
        fz = Fuzzer(address, pid, probe, hang_s=hang_s, strict=False)
        warm_up(client, "fuzz", src)
        for _ in range(3):
            fz.probe()
        baseline = rss_bytes(pid)
        reset_peak_rss(pid)
        t0 = time.monotonic()
        probe_ms = []
        named_cases(fz, "fuzz")
        probe_ms.append(fz.probe())
        while fz.counts["sent_zmq"] + fz.counts["sent_lane"] < messages and not fz.counts["crashes"]:
            fz.zmq_batch(rng, batch // 2)
            fz.lane_batch(rng, batch - batch // 2)
            probe_ms.append(fz.probe())
            sent = fz.counts["sent_zmq"] + fz.counts["sent_lane"]
            if sent // 5000 != (sent - batch) // 5000:
                log(f"  {sent} sent, {time.monotonic() - t0:.0f} s, RSS {(rss_bytes(pid) - baseline) / MiB:+.1f} MiB, "
                    f"failures {len(fz.failures)}")
        fz.settle_zmq()
        peak = peak_rss_bytes(pid) - baseline
        after = rss_bytes(pid) - baseline
        deadline = time.monotonic() + 15      # freed memory may take a moment to be returned
        while after > 10 * MiB and time.monotonic() < deadline and not fz.counts["crashes"]:
            time.sleep(0.5)
            after = rss_bytes(pid) - baseline
        fz.close()
        result.update(seconds=round(time.monotonic() - t0, 1), counts=dict(fz.counts),
                      crashes=fz.counts["crashes"], hangs=fz.counts["hangs"],
                      internal_errors=fz.counts["internal_errors"], failures=fz.failures[:20],
                      baseline_rss_mib=round(baseline / MiB, 1), peak_rss_above_mib=round(peak / MiB, 1),
                      largest_message_mib=round(fz.largest_bytes / MiB, 1), rss_after_mib=round(after / MiB, 1),
                      probe_ms_max=round(max(probe_ms), 1))
    return result


def report(r: dict, f=None) -> None:
    c = r["counts"]
    errors = ", ".join(f"{k[6:]} {v}" for k, v in sorted(c.items()) if k.startswith("error:"))
    accepted = sum(v for k, v in c.items() if k.startswith("accepted:"))
    lines = [
        f"messages sent        {c.get('sent_zmq', 0) + c.get('sent_lane', 0)} "
        f"(ZeroMQ {c.get('sent_zmq', 0)}, lane connections {c.get('sent_lane', 0)}) "
        f"in {r['seconds']} s, seed {r['seed']}",
        f"replies              {c.get('replies', 0)}: errors by code: {errors}; accepted {accepted}",
        f"crashes              {r['crashes']}",
        f"hangs                {r['hangs']} (probes {c.get('probes', 0)}, slowest {r['probe_ms_max']} ms)",
        f"internal errors      {r['internal_errors']}",
        f"wrong probe answers  {c.get('wrong', 0)}",
        f"peak RSS             +{r['peak_rss_above_mib']} MiB above baseline {r['baseline_rss_mib']} MiB "
        f"(largest message {r['largest_message_mib']} MiB; bound 2x = {2 * r['largest_message_mib']:.1f} MiB)",
        f"RSS after            {r['rss_after_mib']:+.1f} MiB vs baseline (bound 10 MiB)",
    ]
    lines += [f"failure: {x}" for x in r["failures"]]
    print("\n".join(lines), file=f)


def passed(r: dict) -> bool:
    """The issue's bar: no crash, hang or failed check; peak RSS within 2x the largest message (+1 MiB of
    noise: ZeroMQ's own copy and pyzmq's make exactly 2x); RSS after within 10 MiB of the baseline."""
    return (r["crashes"] == 0 and r["hangs"] == 0 and r["internal_errors"] == 0 and not r["failures"]
            and r["peak_rss_above_mib"] <= 2 * max(r["largest_message_mib"], 1) + 1
            and r["rss_after_mib"] <= 10)


def main(argv=None) -> int:
    from ..measure import save_results
    ap = Parser(prog="modelcache bench fuzz", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=40000,
                    help="malformed messages in all, both sockets (default 40000)")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed: the same seed sends the same messages")
    ap.add_argument("--batch", type=int, default=200, help="messages between two health probes (default 200)")
    ap.add_argument("--hang-s", type=float, default=10.0, help="an answer later than this is a hang (default 10)")
    ap.add_argument("--out", default=None, help="write results.json and report.txt here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="mc-fuzz-") as tmp:
        r = run_fuzz(args.messages, args.seed, args.batch, args.hang_s, Path(tmp))
    report(r)
    save_results(args.out, "fuzz", argv, r, report)
    return 0 if passed(r) else 1


if __name__ == "__main__":
    raise SystemExit(main())
