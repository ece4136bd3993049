#!/usr/bin/env python3
"""Which signal should the daemon's memory-pressure watcher use, and at what poll interval?

Headroom = cgroup limit - working set (usage - inactive_file here; the daemon also leaves out active file
pages, modelcache/memlimit.py: the child's anonymous growth measured here is the same either way); the
daemon evicts idle models when headroom < reserve. This decides WHICH signal notices that in time when a process beside the daemon
grows at --rate-mib-s. A forked child joins a fresh memory cgroup (limit --limit-mib) and touches
memory in --step-mib steps paced by the clock until headroom is reserve/2. After every step it logs
(step start, step end, the cgroup's working set), so the parent knows when headroom < reserve really
began (interpolated inside the step that crossed it). For each method, run alone: the delay from
that crossing to the moment it noticed, and the headroom left then. Methods: polling the working set
every 10/50/100/250 ms; /proc/meminfo MemAvailable < reserve (machine-wide, blind to the cgroup);
the cgroup v1 usage threshold eventfd; cgroup v1 memory.pressure_level low/medium eventfds; a PSI
memory trigger. Removes its cgroup whatever happens. Needs root.

  python benchmarks/memlimit/reaction.py --runs 5        (writes benchmarks/memlimit/reaction.txt)
"""
import argparse, ctypes, os, random, select, shlex, signal, statistics, struct, sys, time

MiB = 1 << 20
REC = struct.Struct("ddq")                   # step start, step end (monotonic s), working set after it
PSI_SPECS = [b"some 10000 1000000", b"some 10000 2000000"]   # 10 ms stalled in 1 s (2 s: unprivileged)
METHODS = ["poll10ms", "poll50ms", "poll100ms", "poll250ms", "meminfo", "threshold",
           "pressure-low", "pressure-medium", "psi"]


def find_cgroup():
    """(cgroup version, directory to create the child cgroup in), or (None, why not)."""
    mounts = [line.split() for line in open("/proc/mounts")]
    own = dict(line.rstrip("\n").split(":", 2)[1:] for line in open("/proc/self/cgroup"))
    if any(m[1] == "/sys/fs/cgroup" and m[2] == "cgroup2" for m in mounts):
        ver, mnt, rel = 2, "/sys/fs/cgroup", own.get("", "/")
    else:
        mnt = next((m[1] for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")), None)
        if mnt is None:
            return None, "no cgroup v1 memory mount and no cgroup2 at /sys/fs/cgroup"
        ver, rel = 1, own.get("memory", "/")
    path = os.path.join(mnt, rel.lstrip("/"))
    return ver, path if os.path.isdir(path) else mnt


class Cgroup:
    def __init__(self, ver, parent):
        self.ver, self.path, self.fds = ver, os.path.join(parent, f"mc-reaction-{os.getpid()}"), []
        self.key = b"\ntotal_inactive_file " if ver == 1 else b"\ninactive_file "

    def open(self, name, flags=os.O_RDONLY):
        return os.open(os.path.join(self.path, name), flags | os.O_CLOEXEC)

    def create(self, limit):
        os.mkdir(self.path)
        fd = self.open("memory.limit_in_bytes" if self.ver == 1 else "memory.max", os.O_WRONLY)
        os.write(fd, str(limit).encode()), os.close(fd)
        self.fds = [self.open("memory.usage_in_bytes" if self.ver == 1 else "memory.current"),
                    self.open("memory.stat")]

    def working_set(self):
        """usage - inactive_file, read through fds held open (pread at 0 re-reads a cgroup file)."""
        usage, stat = int(os.pread(self.fds[0], 64, 0)), os.pread(self.fds[1], 16384, 0)
        i = stat.find(self.key) + len(self.key)
        return usage - int(stat[i:stat.find(b"\n", i)])

    def remove(self):
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for _ in range(100):                 # EBUSY until the killed child is completely gone
            try:
                return os.rmdir(self.path)
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        print(f"WARNING: could not remove {self.path}", file=sys.stderr)


def mem_available(fd):
    data = os.pread(fd, 8192, 0)
    i = data.find(b"MemAvailable:") + 13
    return int(data[i:data.find(b"kB", i)]) * 1024


def child(cg, go_r, log_w, rate, step):
    """Join the cgroup, wait for 'go' (working set to stop at), touch `step` bytes every step/rate s."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG: die with the parent
        with open(os.path.join(cg.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.write(log_w, b"R")
        stop, = struct.unpack("q", os.read(go_r, 8))
        chunks, t0 = [], time.monotonic()
        ws = cg.working_set()
        os.write(log_w, REC.pack(t0, t0, ws))
        while ws < stop:
            time.sleep(max(0, t0 + len(chunks) * step / rate - time.monotonic()))
            ts = time.monotonic()
            chunks.append(b"\1" * step)                     # malloc + memset: every page touched
            te, ws = time.monotonic(), cg.working_set()
            os.write(log_w, REC.pack(ts, te, ws))
        signal.pause()
    finally:
        os._exit(0)


def arm(method, cg, thr):
    """Open what `method` waits on; returns (fds, note). Raises OSError when it is not available."""
    if method.startswith("poll"):
        return [], ""
    if method == "meminfo":
        return [os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)], ""
    if method == "psi":
        paths = [os.path.join(cg.path, "memory.pressure")] if cg.ver == 2 else \
            ["/proc/pressure/memory", "/sys/fs/cgroup/unified/memory.pressure"]
        errors = []
        for path, spec in [(p, s) for p in paths for s in PSI_SPECS]:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                os.write(fd, spec)
                return [fd], f"trigger '{spec.decode()}' on {path}" + "".join(f"; refused {e}" for e in errors)
            except OSError as e:
                os.close(fd)
                errors.append(f"'{spec.decode()}' on {path} ({e.strerror})")
        raise OSError("refused " + ", ".join(errors))
    if cg.ver != 1:
        raise OSError("cgroup v1 only")
    fds = [os.eventfd(0, os.EFD_CLOEXEC)]                   # threshold, pressure-low, pressure-medium
    fds.append(cg.open("memory.usage_in_bytes" if method == "threshold" else "memory.pressure_level"))
    ctl = cg.open("cgroup.event_control", os.O_WRONLY)
    try:                                                    # (on failure the two fds leak: a probe)
        os.write(ctl, f"{fds[0]} {fds[1]} {thr if method == 'threshold' else method[9:]}".encode())
    finally:
        os.close(ctl)
    return fds, ""


def wait(method, fds, cg, thr, reserve, deadline):
    """Block until `method` notices; returns (monotonic time or None, lowest MemAvailable for meminfo)."""
    if method.startswith("poll") or method == "meminfo":
        interval = int(method[4:-2]) / 1000 if method.startswith("poll") else 0.1
        nxt, low = time.monotonic() + random.random() * interval, None   # a phase independent of the child's
        while nxt < deadline:
            if method == "meminfo":
                low = min(low or 1 << 62, mem_available(fds[0]))
                if low < reserve:
                    return time.monotonic(), low
            elif cg.working_set() >= thr:
                return time.monotonic(), None
            nxt += interval
            time.sleep(max(0, nxt - time.monotonic()))
        return None, low
    p = select.poll()                                       # = a blocking read in a watcher thread
    p.register(fds[0], select.POLLPRI if method == "psi" else select.POLLIN)
    return (time.monotonic() if p.poll(max(0, deadline - time.monotonic()) * 1000) else None), None


def run_once(cg, method, a):
    """One child, one method: {'delay' ms, 'left' MiB headroom at detection, 'rate' MiB/s, ...}."""
    limit, reserve, rate, step = a.limit_mib * MiB, a.reserve_mib * MiB, a.rate_mib_s * MiB, a.step_mib * MiB
    thr, stop = limit - reserve, limit - reserve // 2
    cg.create(limit)
    pid, fds, (go_r, go_w), (log_r, log_w) = None, [], os.pipe(), os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            child(cg, go_r, log_w, rate, step)
        os.close(go_r), os.close(log_w)
        assert os.read(log_r, 1) == b"R", "the child did not start"
        time.sleep(0.05)
        base = cg.working_set()
        fds, _ = arm(method, cg, thr)
        t_go = time.monotonic()
        os.write(go_w, struct.pack("q", stop))
        t_det, low = wait(method, fds, cg, thr, reserve, t_go + 1.1 * (stop - base) / rate + a.grace_s)
        recs, buf = [], b""                  # the child's log, at least up to the crossing and t_det
        while not recs or not (recs[-1][2] >= stop or recs[-1][2] >= thr and recs[-1][1] >= (t_det or 1e99)):
            chunk = os.read(log_r, 65536)
            if not chunk:
                raise RuntimeError(f"the child died early, its log ends at {recs[-1:]}")
            buf += chunk
            n = len(buf) // REC.size * REC.size
            recs += REC.iter_unpack(buf[:n])
            buf = buf[n:]
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        for fd in fds + [go_w, log_r]:
            os.close(fd)
        cg.remove()

    def ws_at(t):                            # the working set at t: stepwise, linear inside a step
        ws = recs[0][2]
        for (_, _, w0), (ts, te, w1) in zip(recs, recs[1:]):
            ws = w1 if t >= te else w0 + (w1 - w0) * (t - ts) / (te - ts) if t > ts else ws
        return ws

    i = next(i for i, r in enumerate(recs) if r[2] >= thr)
    (_, _, w0), (ts, te, w1) = recs[i - 1], recs[i]
    cross = ts + (te - ts) * (thr - w0) / (w1 - w0)
    touched = (len(recs) - 1) * step
    out = dict(base=base / MiB, low=low, rate=(touched - step) / MiB / (recs[-1][0] - recs[1][0]),
               lag=max(r[0] - recs[0][0] - k * step / rate for k, r in enumerate(recs[1:])) * 1000,
               extra=(recs[-1][2] - recs[0][2] - touched) / MiB)
    if t_det is not None:
        out.update(delay=(t_det - cross) * 1000, left=(limit - ws_at(t_det)) / MiB)
    return out


def read_cost(fn, n):
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(n):
        fn()
    return (time.process_time() - c0) / n * 1e6, (time.perf_counter() - w0) / n * 1e6


def mmm(xs, fmt="{:.0f}"):
    f = fmt.format
    return f"{f(statistics.median(xs))} [{f(min(xs))}..{f(max(xs))}]" if xs else "-"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # step 1 MiB: with 4 MiB, a step that ends a few KiB past the threshold delays the v1 threshold
    # event by a whole step (the kernel checks thresholds every 128 page charges a CPU)
    for name, default in [("limit-mib", 1536), ("reserve-mib", 256), ("rate-mib-s", 128.0), ("step-mib", 1),
                          ("runs", 5), ("grace-s", 1.5), ("reads", 10000)]:   # grace: wait past the child's end
        ap.add_argument("--" + name, type=type(default), default=default)    # reads: timed for a poll's cost
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaction.txt"))
    a = ap.parse_args()
    ver, parent = find_cgroup()
    if ver is None or not os.access(parent, os.W_OK):
        print(f"cannot run: {parent if ver is None else parent + ' is not writable'}")
        return 0
    cg, thr = Cgroup(ver, parent), (a.limit_mib - a.reserve_mib) * MiB
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # so that the finally clauses run
    try:
        cg.create(a.limit_mib * MiB)
    except OSError as e:
        print(f"cannot run: creating {cg.path}: {e}")
        return 0
    notes, fd = {}, os.open("/proc/meminfo", os.O_RDONLY)
    try:
        costs = {"working set (usage_in_bytes + memory.stat)": read_cost(cg.working_set, a.reads),
                 "/proc/meminfo MemAvailable": read_cost(lambda: mem_available(fd), a.reads)}
        for m in a.methods:                  # arm each once: the ones that cannot are reported, not run
            try:
                fds, notes[m] = arm(m, cg, thr)
                [os.close(x) for x in fds]
            except OSError as e:
                notes[m] = f"unavailable: {e}"
    finally:
        os.close(fd)
        cg.remove()
    methods = [m for m in a.methods if not notes[m].startswith("unavailable")]
    results = {m: [] for m in a.methods}
    for r in range(a.runs):                  # each round runs every method, in a rotated order
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            x = run_once(cg, m, a)
            results[m].append(x)
            print(f"run {r + 1} {m:16s} " + (f"delay {x['delay']:7.1f} ms  left {x['left']:6.1f} MiB"
                  if "delay" in x else "not noticed") + f"  rate {x['rate']:.1f} MiB/s, lag {x['lag']:.0f} ms", flush=True)
    every = [x for xs in results.values() for x in xs]
    lines = ["$ python " + " ".join(shlex.quote(x) for x in [os.path.relpath(sys.argv[0])] + sys.argv[1:]), "",
             f"kernel {os.uname().release}, cgroup v{ver}, {os.cpu_count()} CPUs; child cgroup {cg.path}",
             f"limit {a.limit_mib} MiB, reserve {a.reserve_mib} MiB: notice when the working set >= "
             f"{a.limit_mib - a.reserve_mib} MiB; the child grows to limit - reserve/2 at {a.rate_mib_s:g} MiB/s "
             f"in {a.step_mib} MiB steps; {a.runs} runs a method; median [min..max]", "",
             f"{'method':16s} {'noticed':>7s}  {'delay ms':>20s}  {'headroom left MiB':>20s}  "
             f"{'rate MiB/s':>18s}"]
    for m in a.methods:
        xs, got = results[m], [x for x in results[m] if "delay" in x]
        if m == "meminfo" and xs:
            notes[m] = f"fires on MemAvailable < reserve; lowest seen {min(x['low'] for x in xs) / MiB:.0f} MiB"
        lines.append(f"{m:16s} {len(got):>3d}/{len(xs):<3d}  {mmm([x['delay'] for x in got]):>20s}  "
                     f"{mmm([x['left'] for x in got]):>20s}  {mmm([x['rate'] for x in xs], '{:.1f}'):>18s}")
    lines += [""] + [f"{m}: {note}" for m, note in notes.items() if note]
    lines += ["", f"working set before the child grew: {mmm([x['base'] for x in every], '{:.1f}')} MiB; "
              f"achieved rate {mmm([x['rate'] for x in every], '{:.1f}')} MiB/s; a run's worst lag behind "
              f"its schedule {mmm([x['lag'] for x in every])} ms",
              f"working-set growth beyond the bytes touched (page tables, COW, per-CPU charge batches): "
              f"{mmm([x['extra'] for x in every], '{:.1f}')} MiB", "",
              f"CPU cost of one read ({a.reads} reads through held-open fds, pread):"]
    lines += [f"  {what:44s} {cpu:6.1f} us CPU, {wall:6.1f} us wall" for what, (cpu, wall) in costs.items()]
    text = "\n".join(lines) + "\n"
    print("\n" + text, end="")
    with open(a.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
