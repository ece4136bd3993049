"""`modelcache ...`: the command line. Each subcommand is a thin layer over the library."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from . import __version__
from .errors import ModelCacheError, PermissionDenied
from .usage import Parser


def _setup_logging(level: str) -> None:
    # Under systemd the journal stamps each line itself; elsewhere we add the time.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)


FLAG_SETTINGS = ("socket", "repository", "log_level", "host_capacity", "memory_reserve", "metrics_port", "gpu_sharing",
                 "triton_repository")


def _settings(args):
    from .config import load
    return load(getattr(args, "config", None), {k: getattr(args, k, None) for k in FLAG_SETTINGS},
                only=getattr(args, "uses", None))


def cmd_daemon(args) -> int:
    from .daemon.server import run
    settings = _settings(args)
    _setup_logging(settings.log_level)
    if getattr(args, "config", None):   # its children (fronts, the Triton import) read the same file
        os.environ["MODELCACHE_CONFIG"] = os.path.abspath(args.config)

    def ready():
        # One line on stdout when clients may connect: tests and scripts wait on it.
        print(f"READY {settings.socket}", flush=True)

    # A reload re-reads the same layers: file, environment, and this command line's flags.
    run(settings, on_ready=ready, reload_settings=lambda: _settings(args))
    return 0


FRONT_PORTS = {"http": 8000, "grpc": 8001}   # Triton's defaults, so both fronts run side by side


def cmd_front(args) -> int:
    """`modelcache http` and `modelcache grpc`: one protocol front in front of the daemon."""
    import importlib
    import socket

    from .address import check_can_connect, check_listening, listen_tcp, reserve_tcp
    kind = args.cmd
    try:   # httptools is the [http] extra, grpcio the [grpc] one
        run = importlib.import_module(f"modelcache.{kind}.server").run
    except ImportError as e:
        raise ModelCacheError(f"the {kind} front needs the [{kind}] extra (pip install 'modelcache[{kind}]'): {e}") \
            from None
    settings = _settings(args)
    _setup_logging(settings.log_level)
    host = args.host or getattr(settings, f"{kind}_host")
    port = args.port if args.port is not None else (getattr(settings, f"{kind}_port") or FRONT_PORTS[kind])
    where = f"--port {port}" if args.port is not None else \
        f"{kind}_port {port}" if getattr(settings, f"{kind}_port") else f"the default port {port}"
    # Bound here, before serving: a port we cannot have is one line naming where it was asked for. The daemon
    # binds its HTTP front's port itself and hands it over (--listen-fd); grpc binds only what it listens on, so
    # its port is held here bound, beside it (SO_REUSEPORT: see daemon/children.py, which holds it too).
    if kind == "grpc":
        sock = reserve_tcp(host, port, where)
    else:
        sock = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else listen_tcp(host, port, where)
    if not args.daemons and settings.socket.startswith("ipc://"):
        # A front with no daemon behind it would answer every request 503: refuse to start instead (the
        # daemon's own front starts once the daemon listens). Once up, it rides out restarts.
        check_can_connect(settings.socket[len("ipc://"):], settings.socket)
        check_listening(settings.socket[len("ipc://"):], settings.socket)

    def ready(url):
        print(f"READY {url}", flush=True)   # as the daemon's: tests and scripts wait on it

    if kind == "grpc":
        run(settings, host, sock.getsockname()[1], on_ready=ready, reserved=sock)
    else:
        run(settings, host, port, on_ready=ready, sock=sock)
    return 0


def cmd_import_triton(args) -> int:
    from .triton_repo.importer import import_repository
    settings = _settings(args)
    _setup_logging(settings.log_level)

    def out(line):
        print(line, flush=True)
    if args.poll is not None:
        from .triton_repo.poll import RepositoryPoller
        if args.dry_run or args.model:
            raise ModelCacheError("--poll watches the whole repository and imports what changes: without "
                                  "--dry-run or --model")
        from pathlib import Path
        if not Path(args.source).is_dir():
            raise ModelCacheError(f"{args.source} is not a directory: give a Triton model repository to watch")
        def set_unloaded(name: str, unloaded: bool) -> None:   # (a daemon's: with none, nothing serves anyway)
            from .client.connection import connect
            with connect(settings.socket, timeout_s=settings.add_timeout_s) as client:
                client.set_unloaded(name, unloaded)
        RepositoryPoller(Path(args.source), lambda names: import_repository(
            args.source, settings, only=names, out=out, replace=True), out, set_unloaded).run(args.poll)
        return 0
    report = import_repository(args.source, settings, only=args.model, dry_run=args.dry_run, out=out,
                               replace=args.replace)
    return 1 if report.failed else 0


def _count(n: int, noun: str, nouns: str = "") -> str:
    from .daemon.wording import plural
    return plural(n, noun, nouns)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ago(ts: float) -> str:
    if not ts:
        return "never"
    s = time.time() - ts
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.1f}h ago"


def _in(ts: float) -> str:
    """How long until a time to come, as a person reads it: '42s', '9m', '1.5h' ('0s': now or past)."""
    s = max(0.0, ts - time.time())
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def print_models(models: list[dict], out=sys.stdout) -> None:
    """HOST and GPU: what each tier charges for the model, by its own accounting (HOST, for a model not in
    the host tier: what loading it takes there); FREES: what evicting it alone would free in the host tier now
    (less than HOST where it shares tensors with other resident models); DISK: its stored weights, every variant. WHY: why it is in
    the host tier (in use, pinned, pre-warmed, kept alive: its keep-alive window is open, cached: it stays
    until room is needed) or on its way there (loading, waiting for room); empty from an older daemon."""
    if not models:
        print("no models; add one with `modelcache add FILE.onnx --name NAME`", file=out)
        return
    print(f"{'NAME':<20} {'VER':>4} {'HOST':>10} {'FREES':>10} {'GPU':>10} {'DISK':>10} {'TIER':<6} {'STATE':<9} "
          f"{'REFS':>4} {'HITS':>5} {'PIN':<3} {'LAST USE':<10} WHY", file=out)
    for m in models:
        host, gpu, frees = m.get("host_bytes", m["bytes"]), m.get("gpu_bytes", 0), m.get("frees_bytes")
        frees = "-" if not frees or m["tier"] in ("disk", "remote") else _human(frees)
        why = m.get("why") or ""
        if m.get("keep_alive_until") and "kept alive" in why:
            why += f" ({_in(m['keep_alive_until'])} left)"
        print(f"{m['name']:<20} {m['version']:>4} {_human(host) if host else '-':>10} {frees:>10} "
              f"{_human(gpu) if gpu else '-':>10} {_human(m['bytes']):>10} {m['tier']:<6} {m['state']:<9} "
              f"{m['refcount']:>4} {m['hits']:>5} {'yes' if m.get('pinned') else '':<3} {_ago(m['last_use']):<10} "
              f"{why}".rstrip(), file=out)


def print_keep_alive(models: list[dict], out=sys.stdout) -> None:
    """The timed policies' view (eviction_policy keepalive or hybrid): per model, until when it is kept while
    idle, and when its next call is expected (hybrid, once its calls show a pattern)."""
    timed = [m for m in models if m.get("keep_alive_until") or m.get("next_call")
             or any(g.get("keep_alive_until") for g in m.get("gpu", ()))]
    if not timed:
        return
    print("\nKEEP-ALIVE", file=out)

    def at(ts: float) -> str:
        return f"{time.strftime('%H:%M:%S', time.localtime(ts))} (in {_in(ts)})"
    for m in timed:
        parts = [f"host: kept until {at(m['keep_alive_until'])}"] if m.get("keep_alive_until") else []
        parts += [f"GPU {g['device']}: kept until {at(g['keep_alive_until'])}" for g in m.get("gpu", ())
                  if g.get("keep_alive_until")]
        if m.get("next_call"):
            parts.append(f"next call expected {at(m['next_call'])}")
        print(f"  {m['name']}@{m['version']}: {'; '.join(parts)}", file=out)


def cmd_ls(args) -> int:
    from .client.connection import connect
    with connect(_settings(args).socket) as c:
        listing = c.listing()
    print_models(listing.models + _remote_models(listing.remote, listing.models))
    return 0


def _remote_models(url: str, local: list[dict]) -> list[dict]:
    """The remote store's versions the daemon does not have yet (tier "remote": fetched on first open),
    read here from its index so that listing never waits on the network in the daemon."""
    if not url:
        return []
    from .errors import RemoteError
    from .store.format import WEIGHTS_FILE
    from .tiers.remote import RemoteStore
    try:
        index = RemoteStore(url, timeout_s=10).index()
    except RemoteError as e:
        print(f"modelcache: not listing the remote store's models (fetched on first open): {e}", file=sys.stderr)
        return []
    have = {(m["name"], m["version"]) for m in local}
    return [{"name": e["name"], "version": e["version"], "bytes": e["files"].get(WEIGHTS_FILE, {}).get("bytes", 0),
             "host_bytes": 0, "gpu_bytes": 0, "tier": "remote", "state": "remote", "refcount": 0, "hits": 0,
             "pinned": False, "last_use": 0.0}
            for e in sorted(index, key=lambda e: (e["name"], e["version"])) if (e["name"], e["version"]) not in have]


def _tier_arg(text: str) -> str:
    if text == "host" or text.partition(":")[0] == "gpu":
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: use host, gpu, or gpu:UUID / gpu:INDEX")


def cmd_load(args) -> int:
    from .client.connection import connect
    t0 = time.perf_counter()
    with connect(_settings(args).socket) as c:
        done = c.load(args.name, args.version, args.tier)
    seconds = time.perf_counter() - t0
    if done is None:    # a daemon older than the outcome reply
        print(f"{args.name} is resident in the {args.tier} tier ({seconds:.2f} s)")
        return 0
    key, added = f"{done.name}@{done.version}", [t for t in done.after if t not in done.before]
    print(f"{key} was already in {_tiers_text(done.before)}" if not added else
          f"loaded {key} into {_tiers_text(added)} in {seconds:.2f} s"
          + (f" (it was in {_tiers_text(done.before)})" if done.before else " (from disk)"))
    return 0


def cmd_pin(args) -> int:
    from .client.connection import connect
    pin = args.cmd == "pin"
    with connect(_settings(args).socket) as c:
        done = c.pin(args.name, args.version, pinned=pin)
    if done is None:
        print(f"{args.name}: {'pinned' if pin else 'unpinned'}")
        return 0
    key = f"{done.name}@{done.version}"
    where = f"it is in {_tiers_text(done.after)}" if done.after else "it is on disk only"
    if done.was_pinned == pin:
        print(f"{key} was already {'pinned' if pin else 'not pinned'}; {where}")
    elif pin:
        print(f"pinned {key}: the eviction policy will not evict it to make room (`modelcache evict` still can); "
              f"{where}")
    else:
        print(f"unpinned {key}: the eviction policy may evict it again; {where}")
    return 0


def cmd_rm(args) -> int:
    from .client.connection import connect
    with connect(_settings(args).socket) as c:
        c.remove(args.name, args.version)
    print(f"removed {args.name}@{args.version} from the repository")
    return 0


def cmd_verify(args) -> int:
    """With a daemon running, the daemon scrubs (and serves again what it finds intact); else, or for a
    --repository named on the command line, read here."""
    from .client.connection import connect
    from .errors import DaemonUnavailable, ModelNotFound
    from .store.scrub import DAMAGED, VersionReport, nothing_to_verify, verify_repository
    settings = _settings(args)
    client = None
    if not args.repository:
        try:
            client = connect(settings.socket)
        except DaemonUnavailable:
            pass
    if client is not None:
        with client:
            reply = client.verify(args.name)
        root, reports = reply.root, [(VersionReport.from_wire(r), r["cleared"]) for r in reply.reports]
    else:
        root = settings.repository_path
        reports = [(r, False) for r in verify_repository(root, args.name)]
        if not reports:
            raise ModelNotFound(nothing_to_verify(root, args.name))
    for r, cleared in reports:
        print(r.line() + ("  (was marked corrupt: served again)" if cleared else ""), flush=True)
    damaged = sum(r.status == DAMAGED for r, _ in reports)
    print(f"{_count(len(reports), 'version')} checked in {root}: " +
          (f"{damaged} DAMAGED" if damaged else "no damage"))
    return 1 if damaged else 0


def cmd_publish(args) -> int:
    from pathlib import Path
    from .store.format import MANIFEST_FILE
    from .tiers.remote import publish
    if not list(Path(args.directory).glob(f"*/*/{MANIFEST_FILE}")):   # (an empty index would serve nothing)
        raise ModelCacheError(f"{args.directory} is not a repository: no NAME/VERSION/{MANIFEST_FILE} under it; "
                              f"publish the repository directory (MODELCACHE_REPOSITORY), or a copy of it")
    index = publish(args.directory)
    print(f"wrote {args.directory}/index.json: {_count(len(index['models']), 'model version')}; serve the "
          f"directory (e.g. python -m http.server) and point MODELCACHE_REMOTE at it")
    return 0


def cmd_partition(args) -> int:
    from .client.connection import connect
    plan = None
    if args.plan:
        from .placement.plan import load_plan
        plan = load_plan(args.plan)
    with connect(_settings(args).socket) as c:
        stages = c.partition(args.name, args.stages, args.tail_fraction, args.version, plan=plan)
    if not stages:
        print(f"{args.name}: one stage (not partitioned)")
    for i, st in enumerate(stages):
        where = f"  on {', '.join(st['workers'])}" if st.get("workers") else ""
        print(f"stage {i}: {st['file']}  {', '.join(st['inputs'])} -> {', '.join(st['outputs'])}  "
              f"{100 * st['cost_share']:.0f}% of measured compute{where}")
    return 0


def cmd_place(args) -> int:
    from .placement.command import run
    return run(args, _settings(args))


def cmd_calibrate(args) -> int:
    from .client.calibrate import calibrate
    from .client.connection import connect
    with connect(_settings(args).socket, timeout_s=600) as c:
        profile = calibrate(c, args.name, args.batches, args.runs, args.t_opt_ms, args.version,
                            progress=lambda line: print(line, flush=True))
    z = ", ".join(f"{v:.4g}" for v in profile["g"])
    print(f"{args.name}: g(b) fit z = ({z}); t_opt {profile['t_opt_ms']:.0f} ms -> N_opt {profile['n_opt']}; "
          "stored with the model")
    return 0


def cmd_evict(args) -> int:
    from .client.connection import connect
    with connect(_settings(args).socket) as c:
        done = c.evict(args.name, args.version, tier=args.tier)
    print(evict_line(done) if done is not None else f"{args.name}: evict ({args.tier}) done")
    return 0


def _tiers_text(tiers: list) -> str:
    return " and ".join("the host tier" if t == "host" else f"GPU {t.partition(':')[2]}" for t in tiers)


def evict_line(r) -> str:
    """What an evict did, from the daemon's ModelOutcome: the version, where it was, where it is now."""
    key = f"{r.name}@{r.version}"
    now = f"it stays in {_tiers_text(r.after)}" if r.after else "it is on disk only now"
    if not r.before:
        return f"{key} was not in memory (on disk only): nothing to evict"
    gone = [t for t in r.before if t not in r.after]
    if not gone:
        return f"{key} was not on any GPU: nothing to demote; {now}"
    verb = "demoted" if "host" in r.after else "evicted"     # (from the GPUs to the host tier it stays in)
    return f"{verb} {key} from {_tiers_text(gone)} ({_human(r.freed_bytes)} freed); {now}"


def cmd_status(args) -> int:
    from .client.connection import connect
    with connect(_settings(args).socket, timeout_s=5) as c:
        print(format_status(c.stats()))
    return 0


def format_status(st) -> str:
    """One screen a person reads: the daemon, its tiers, its models, its clients."""
    import io
    out = io.StringIO()
    up = st.uptime_s
    print(f"modelcache {st.daemon_version}  pid {st.pid}  up {int(up // 3600)}h{int(up % 3600 // 60):02d}m"
          f"{int(up % 60):02d}s  {st.socket}", file=out)
    c = st.counters
    print(f"opens {c.get('opens', 0)} (hits {c.get('hits', 0)}, misses {c.get('misses', 0)}, "
          f"from the repository's files {c.get('opens_from_disk', 0)})  "
          f"evictions {c.get('evictions', 0)}  unloads {c.get('unloads', 0)}  pre-warms {c.get('prewarms', 0)}  "
          f"clients lost {c.get('clients_lost', 0)}  "
          f"bad messages {c.get('bad_messages', 0)}", file=out)
    if any(t["tier"] == "gpu" for t in st.tiers):
        print(f"gpu: {_count(c.get('gpu_promotions', 0), 'promotion')}, {_count(c.get('gpu_evictions', 0), 'demotion')}",
              file=out)
    ex = st.executor or {}
    if ex:
        b = ex.get("batching", {})
        p50, p99 = ex.get("latency_ms_p50"), ex.get("latency_ms_p99")
        policies = ", ".join(f"{k}={v}" for k, v in b.get("policies", {}).items())
        workers = ", ".join(w["kind"] + (" (out of service: see the log)" if w.get("disabled") else "")
                            for w in ex.get("workers", [])) or "no workers"
        refused = ex.get("refused") or {}
        refused_text = ", ".join(f"{n} {why}" for why, n in (("refused by a full queue", refused.get("queue_full")),
                                                              ("timed out in a queue", refused.get("queue_timeout"))) if n)
        print(f"serve: {ex.get('served', 0)} served, {ex.get('failed', 0)} failed"
              + (f" ({refused_text})" if refused_text else "") + f", {ex.get('in_flight', 0)} in flight "
              f"({ex.get('queued', 0)} queued)" + (f", p50 {p50:.1f} ms, p99 {p99:.1f} ms" if p50 is not None else "")
              + f"; {ex.get('scheduler')} over {workers}"
              + ("" if ex.get("lane_connections") is None else f"; {ex['lane_connections']} on the serve lane"),
              file=out)
        mean = b.get("mean_batch")
        print(f"batching: {policies}; {_count(b.get('batches', 0), 'batch', 'batches')}"
              + (f", mean {mean:.2f} requests" if mean else "")
              + f", {_count(b.get('layer_joins', 0), 'layer join')}", file=out)
        rc = ex.get("response_cache") or {}
        if rc.get("hits") or rc.get("misses") or rc.get("entries"):   # (only where a model asks for one)
            print(f"response cache: {rc['hits']} hits, {rc['misses']} misses; {_count(rc['entries'], 'answer')}, "
                  f"{rc['bytes'] / 2**20:.1f} / {rc['capacity_bytes'] / 2**20:.0f} MiB in the daemon", file=out)
    print("\nTIER   USED / CAPACITY          PATH", file=out)
    for t in st.tiers:
        cap = _human(t["capacity_bytes"]) if t["capacity_bytes"] else "unbounded"
        pct = f" ({100 * t['used_bytes'] / t['capacity_bytes']:.0f}%)" if t["capacity_bytes"] else ""
        if t["tier"] == "gpu":  # where: the device; and which models GPU clients hold there
            leased = ", ".join(f"{k} ({_count(n, 'lease')})" for k, n in t.get("leased", {}).items())
            where = f"GPU {t['index']} {t['name']} {t['device']}" + (f"; held: {leased}" if leased else "")
            if t.get("sharing"):   # (an older daemon does not say)
                shared = "read-only (vmm)" if t["sharing"] == "vmm-read-only" else "read-write (legacy ipc)"
                note = f" ({t['sharing_note']})" if t.get("sharing_note") else ""
                where += f"; shared {shared}{note}"
        else:
            where = t["path"]
        waits = t.get("waiting") or {}   # (an older daemon does not say)
        if waits.get("requests"):
            where += (f"; {_count(waits['requests'], 'request')} waiting for room "
                      f"({_count(waits['models'], 'model')})")
        print(f"{t['tier']:<6} {_human(t['used_bytes']) + ' / ' + cap + pct:<24} {where}", file=out)
    host = next((t for t in st.tiers if "memory_limit_bytes" in t), None)   # (an older daemon does not say)
    if host is not None:
        counters = st.counters
        print(f"memory: limit {_human(host['memory_limit_bytes'])} ({host['memory_limit_source']}), "
              f"{_human(max(0, host['headroom_bytes']))} free, {_human(host['memory_reserve_bytes'])} kept free "
              f"(memory_reserve); {_count(counters.get('pressure_evictions', 0), 'idle model')} given back under "
              "pressure", file=out)
    print(file=out)
    print_models(st.models, out)
    print_keep_alive(st.models, out)
    corrupt = [m for m in st.models if m.get("corrupt")]
    if corrupt:
        print(f"\n{_count(len(corrupt), 'corrupt version')} (not served; after repairing a file, "
              f"`modelcache verify NAME` re-checks it and serves it again):", file=out)
        for m in corrupt:
            print(f"  {m['corrupt']}", file=out)
    print(f"\n{_count(len(st.clients), 'client')}", file=out)
    for cl in st.clients:
        print(f"  pid {cl['pid']:<8} {cl['name'][:24]:<24} leases {cl['leases']:<3} idle {cl['idle_s']:.1f}s", file=out)
    for j in st.jobs:
        print(f"  job {j['kind']} {j['model']} {_human(j.get('bytes_done', 0))}/{_human(j.get('bytes_total', 0))}",
              file=out)
    return out.getvalue().rstrip()


def cmd_stats(args) -> int:
    import json
    from .client.connection import connect
    with connect(_settings(args).socket) as c:
        stats = c.stats().to_dict()
    stats.pop("req_id")                 # the wire's, not the daemon's
    print(json.dumps(stats, indent=1))
    return 0


def cmd_add(args) -> int:
    from .client.connection import connect
    settings = _settings(args)
    path = os.path.abspath(args.file)
    try:
        client = connect(settings.socket)
    except PermissionDenied:
        raise  # a daemon runs but is not ours to use: packing into our own repository instead would mislead
    except ModelCacheError:
        if args.require_daemon:
            raise
        client = None
    if client is None:  # no daemon: pack straight into the repository; a daemon finds it when it starts
        from .store.packing import pack
        from .tiers.disk import Repository
        repo = Repository(settings.repository_path)
        t0 = time.perf_counter()  # (no version given: pack reserves the next free one, safe against other adds)
        m = pack(path, repo.root, args.name, args.version, args.opt_level or settings.opt_level, _progress_bar(),
                 owner_uid=os.getuid(), with_prepacked=settings.prepack if args.prepack is None else args.prepack,
                 declared=_declared(args))
        print(f"\nadded {m.name}@{m.version} to {repo.root} (no daemon running): {len(m.tensors)} tensors, "
              f"{_human(m.weights_bytes)}, {time.perf_counter() - t0:.2f} s")
        return 0
    with client:
        r = _add_with_progress(client, settings.socket, path, args)
    print(f"added {r.name}@{r.version}: {r.tensors} tensors, {_human(r.weights_bytes)}, packed in {r.pack_s:.2f} s")
    return 0


def _declared(args) -> dict | None:
    """What `add`'s flags declare of the model's serving (as a Triton config would: triton_repo/config.py)."""
    return {"serving": {"response_cache": True}} if args.response_cache else None


def _add_with_progress(client, socket: str, path: str, args):
    """Ask the daemon to pack; meanwhile show its progress, read from `stats` on a second connection."""
    import threading
    from .client.connection import connect

    show = _progress_bar()
    result: dict = {}

    def add():
        try:
            result["reply"] = client.add(path, args.name, args.version, args.opt_level, prepack=args.prepack,
                                         declared=_declared(args))
        except BaseException as e:  # re-raised on the main thread
            result["error"] = e

    worker = threading.Thread(target=add, daemon=True)
    worker.start()
    if show is not None:
        with connect(socket) as watcher:
            while worker.is_alive():
                worker.join(0.25)
                for job in watcher.stats().jobs:
                    if job["kind"] == "add" and job["model"].startswith(args.name + "@") and job["bytes_total"]:
                        show(job["bytes_done"], job["bytes_total"])
        print(file=sys.stderr)
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["reply"]


def _progress_bar():
    if not sys.stderr.isatty():
        return None
    state = {"last": 0.0}

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if now - state["last"] < 0.1 and done < total:
            return
        state["last"] = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        print(f"\rpacking [{bar:<30}] {frac * 100:5.1f}% {_human(done)}/{_human(total)}", end="", file=sys.stderr)
    return show


def cmd_zoo(args) -> int:
    from . import zoo
    if args.list or not args.name:
        for name, entry in zoo.ZOO.items():
            params = f"{entry.published_params / 1e6:.2f}M params" if entry.published_params else "test model"
            print(f"{name:<15} {params:<16} {entry.summary}")
        return 0
    model = zoo.build(args.name, seed=args.seed)
    out = args.output or f"{args.name}.onnx"
    zoo.save(model, out)
    print(f"wrote {out}: {zoo.count_params(model) / 1e6:.2f}M parameters")
    return 0


def cmd_demo(args) -> int:
    from .demo import demo
    return demo(args)


# What a user runs on their own machine to size or check a deployment (modules of modelcache.bench). The
# benchmarks that recorded a design decision, and the research (trace sweeps, placement against the papers'
# baselines, cluster routing), live in the checkout's benchmarks/ beside their results: not installed.
BENCHMARKS = {
    "coldstart": "fresh FaaS processes from exec to first result, TrIMS-style (--device cuda: the GPU form)",
    "open": "session ready time, private memory and warm speed vs plain ORT (the demo, with more runs)",
    "tiers": "open latency per tier (host hit, disk miss, remote miss) and promotion throughput vs cp",
    "executor": "serve mode: overhead over in-process ORT, throughput per worker layout and scheduler",
    "serve": "batching policies under open-loop Poisson load: latency and the highest sustainable rate",
    "http": "what the Open Inference Protocol (v2 HTTP) front adds over the serve lane",
    "conformance": "ONNX's backend test models: what plain ORT runs, modelcache adds and runs, same outputs",
    "fuzz": "malformed messages on both sockets of a running daemon: it answers and stays up",
    "soak": "many clients, churn and eviction against one daemon for minutes: memory and latency slopes",
    "restart": "SIGKILL the daemon under clients holding sessions: the new daemon's first open, warm vs cold",
}


def cmd_bench(args) -> int:
    import importlib
    return importlib.import_module(f"modelcache.bench.{args.which}").main(args.rest)


def _number_arg(kind=int, low=None, high=None, above=None):
    """An argparse type: a number within its range, refused with the range (a version is >= 1, a port <= 65535)."""
    def parse(text: str):
        from .config import number
        try:
            return number(kind, low, high, above)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text} {e}") from None
    parse.__name__ = kind.__name__   # (what argparse calls the type in its own messages)
    return parse


_version_arg = _number_arg(int, low=1)
_port_arg = _number_arg(int, low=0, high=65535)
_count_arg = _number_arg(int, low=1)


class _DaemonsRepository(argparse.Action):
    """--repository on a command that asks the daemon: the daemon reads its own repository, so taking the
    flag and ignoring it would mislead; say where it is set instead."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error("--repository: this command asks the running daemon, whose repository is set where the "
                     "daemon starts (`modelcache daemon --repository DIR`, or MODELCACHE_REPOSITORY in its "
                     "environment or config file)")


def build_parser() -> argparse.ArgumentParser:
    from .config import CLIENT_SETTINGS
    from .store.reservations import LOCK_SAY_EVERY_S, LOCK_WAIT_S
    # The settings each kind of command reads (set_defaults(uses=...)); the others keep their defaults unread, so
    # that a daemon-only setting that is wrong in the config file never breaks a command that asks the daemon.
    add_settings = CLIENT_SETTINGS + ("repository", "opt_level", "prepack")
    place_settings = CLIENT_SETTINGS + ("repository", "workers", "gpus")
    p = Parser(
        prog="modelcache",
        description="A resident ONNX model cache. Run `modelcache daemon`, add models once with "
                    "`modelcache add`, then open them by name from any process with "
                    "modelcache.InferenceSession(name): the weights are mapped from shared memory.")
    p.add_argument("--version", action="version", version=f"modelcache {__version__}")
    debug_help = "on a failure, print the traceback too (also with log level debug)"
    p.add_argument("--debug", action="store_true", help=debug_help)
    # Options every command that reads settings takes. `asks` (the commands that ask a running daemon) refuses
    # --repository with where to set it; `common` (the commands that read the repository themselves) takes it.
    asks = Parser(add_help=False)
    asks.add_argument("--socket", help="daemon address: ipc://PATH (or an absolute PATH), or tcp://HOST:PORT "
                                       "(default: $MODELCACHE_SOCKET, else ipc://$XDG_RUNTIME_DIR/modelcache/daemon.sock)")
    asks.add_argument("--config", help="TOML settings file (default: $MODELCACHE_CONFIG, "
                                       "~/.config/modelcache/modelcache.toml, /etc/modelcache/modelcache.toml as root)")
    asks.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    common = Parser(add_help=False, parents=[asks])
    common.add_argument("--repository", help="packed models directory (default: $MODELCACHE_REPOSITORY)")
    asks.add_argument("--repository", action=_DaemonsRepository, help=argparse.SUPPRESS)
    asks.set_defaults(uses=CLIENT_SETTINGS)
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("daemon", parents=[common], help="run the daemon in the foreground",
                       description="Run the daemon in the foreground. Prints 'READY <socket>' on stdout "
                                   "when clients may connect (and tells systemd, under Type=notify). "
                                   "SIGTERM or Ctrl-C stops it gracefully (running loads finish, waiting "
                                   "clients get answers), a second one at once; SIGHUP re-reads the "
                                   "settings that can change live (log_level, heartbeat_interval_s, "
                                   "lease_timeout_s, host_capacity, memory_reserve, and the batching settings). "
                                   "Inside a memory limit (a cgroup: systemd's MemoryMax=, a container) it sizes "
                                   "its tier from that limit and gives idle models back when memory runs short "
                                   "(docs/tiers.md, 'Inside a memory limit'). At start it "
                                   f"waits up to {LOCK_WAIT_S:.0f} s for the repository's lock "
                                   "(REPOSITORY/.lock) while another process holds it, logging which one every "
                                   f"{LOCK_SAY_EVERY_S:.0f} s; then it starts without sweeping the repository's "
                                   "half-written versions.")
    d.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    d.add_argument("--host-capacity", help="host-tier size: bytes (8G, 512M) or percent of the memory limit, RAM or "
                                           "the cgroup's (50%%); refused above the limit less --memory-reserve")
    d.add_argument("--memory-reserve", help="memory kept free under the memory limit: idle models are given back "
                                            "below it, and a load that would leave less fails (auto: a tenth of the "
                                            "limit, 256M to a quarter)")
    d.add_argument("--metrics-port", type=_port_arg,
                   help="serve Prometheus metrics on this port (0: off, the default)")
    d.add_argument("--gpu-sharing", choices=["ipc", "vmm-read-only"],
                   help="how clients map GPU weights: ipc (the default: legacy CUDA IPC, every client may write "
                        "them) or vmm-read-only (CUDA's virtual memory API, clients map them read-only; not yet "
                        "verified on a GPU; where the driver refuses it, ipc, as status says)")
    d.set_defaults(func=cmd_daemon, uses=None)

    fronts = {"http": ("serve the Open Inference Protocol (KServe v2 REST) in front of the daemon",
                       "HTTP/REST v2 endpoints (health, metadata, infer with JSON or binary tensors, the model-repository "
                       "extension) for Triton and KServe clients"),
              "grpc": ("serve Triton's gRPC protocol (tritonclient.grpc, KServe v2 gRPC) in front of the daemon",
                       "Triton's inference.GRPCInferenceService (health, metadata, config, statistics, repository, "
                       "infer and stream infer) and grpc.health.v1 for Triton and KServe gRPC clients")}
    for kind, (summary, what) in fronts.items():
        h = sub.add_parser(kind, parents=[asks], help=summary,
                           description=f"{what}; requests go to the daemon's serve mode over its lane, except those of a "
                                       "model the daemon would only run alone inline, which the front runs itself over "
                                       "the daemon's shared weights (setting front_runs). Triton's system shared-memory "
                                       "extension is served once the operator allows it (setting client_shared_memory, "
                                       "off by default). Prints 'READY <address>' once "
                                       "listening; SIGTERM stops it after in-flight requests.")
        h.add_argument("--host", help=f"address to listen on (default: {kind}_host, 127.0.0.1)")
        h.add_argument("--port", type=_port_arg, help=f"port (default: {kind}_port if set, else {FRONT_PORTS[kind]}; "
                                                      "0 picks a free one)")
        h.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
        # the daemon's own front (daemon/children.py): started once the daemon listens; the port it hands over
        h.add_argument("--daemons", action="store_true", help=argparse.SUPPRESS)
        h.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)
        h.add_argument("--triton-repository", metavar="DIR",
                       help="the Triton model repository a repository load reads a model from again (default: the "
                            "triton_repository setting; the daemon's own front gets the daemon's)")
        h.set_defaults(func=cmd_front, uses=CLIENT_SETTINGS + ("log_level", f"{kind}_host", f"{kind}_port",
                                                               "max_message_size", "client_shared_memory",
                                                               "front_hold_s", "triton_repository", "model_control"))
    it = sub.add_parser("import-triton", parents=[common],
                        help="add the ONNX models (and their ensembles) of a Triton model repository",
                        description="Read a Triton model repository (MODEL/config.pbtxt, MODEL/VERSION/model.onnx) and "
                                    "add each ONNX model version its version_policy serves, with its configuration: "
                                    "max_batch_size and dynamic_batching become its batching, sequence_batching its "
                                    "sequences (control inputs, implicit state), and the fronts answer ModelConfig "
                                    "with it. Ensembles whose steps are all ONNX models are added after them; one with "
                                    "a step modelcache cannot serve is skipped with a line naming the step. A version "
                                    "already imported unchanged is skipped; other backends are skipped with one line "
                                    "each; fields not honoured are listed. Goes through the daemon when one runs, else "
                                    "writes the repository directly. Exit status 1 when a model could not be imported.")
    it.add_argument("source", metavar="REPO", help="the Triton model repository (a directory of model directories)")
    it.add_argument("--model", action="append", help="import only this model (repeat for more)")
    it.add_argument("--dry-run", action="store_true", help="check and say what would be imported; add nothing")
    it.add_argument("--poll", type=_number_arg(float, above=0), metavar="SECONDS",
                    help="keep watching: every SECONDS, import again (with --replace) each model whose directory "
                         "changed, as Triton's --model-control-mode=poll (a directory that goes is said, its model "
                         "left served); runs until stopped")
    it.add_argument("--replace", action="store_true",
                    help="replace a version changed since its import (another file or configuration) rather than "
                         "refuse it, once no session holds it, and remove the versions each model's version_policy "
                         "no longer serves: what a repository load over HTTP or gRPC does for one model")
    it.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    it.set_defaults(func=cmd_import_triton, uses=CLIENT_SETTINGS + ("repository", "opt_level", "prepack", "log_level"))

    a = sub.add_parser("add", parents=[common], help="validate, optimize and pack an .onnx file",
                       description="Validate an .onnx file (onnx checker, ONNX Runtime builds it), optimize "
                                   "it once with ORT and store it packed in the repository. Goes through "
                                   "the daemon when one runs, else writes the repository directly.")
    a.add_argument("file")
    a.add_argument("--name", required=True)
    a.add_argument("--version", type=_version_arg, help="default: one more than the newest version")
    a.add_argument("--opt-level", choices=["disable", "basic", "extended", "all"])
    a.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=None,
                   help="also store MLAS-prepacked MatMul weights that every client shares (MatMul-heavy models: "
                        "warm runs as fast as plain ORT, opens ~0.3 s slower, twice the host tier); "
                        "default: the prepack setting (off)")
    a.add_argument("--response-cache", action="store_true",
                   help="serve mode answers inputs it has answered before from the daemon's response cache "
                        "(only for a model whose outputs depend on its inputs alone; response_cache_size bounds it)")
    a.add_argument("--require-daemon", action="store_true", help="fail instead of packing offline")
    a.set_defaults(func=cmd_add, uses=add_settings)

    ls = sub.add_parser("ls", parents=[asks], help="list models: version, bytes, tier, refcount, last use")
    ls.set_defaults(func=cmd_ls)
    ld = sub.add_parser("load", parents=[asks], help="prefetch a model into the host tier or a GPU "
                                                       "(from disk or remote)")
    ld.add_argument("name")
    ld.add_argument("--version", type=_version_arg)
    ld.add_argument("--tier", default="host", type=_tier_arg,
                    help="host (default), gpu (the first GPU), or gpu:UUID / gpu:INDEX")
    ld.set_defaults(func=cmd_load)
    for verb, text in (("pin", "never evict this model"), ("unpin", "let the eviction policy evict it again")):
        pn = sub.add_parser(verb, parents=[asks], help=text)
        pn.add_argument("name")
        pn.add_argument("--version", type=_version_arg)
        pn.set_defaults(func=cmd_pin)
    pt = sub.add_parser("partition", parents=[asks], help="split a model into stages for serve mode",
                        description="Cut a model where exactly one tensor crosses, balancing the compute ORT's "
                                    "profiler measures per node; the split is checked against the whole model.")
    pt.add_argument("name")
    pt.add_argument("--version", type=_version_arg)
    how = pt.add_mutually_exclusive_group(required=True)
    how.add_argument("--stages", type=_count_arg, help="K stages of about equal compute (1 removes a partition)")
    how.add_argument("--tail-fraction", type=_number_arg(float, above=0, high=0.99),
                     help="two stages, the second with this share of compute")
    how.add_argument("--plan", help="a plan from `modelcache place` (searched on this machine's --describe): "
                                    "its stages, each served on its worker set (dmda picks within it)")
    pt.set_defaults(func=cmd_partition)
    pl = sub.add_parser("place", parents=[common], help="search where a model's stages run (MARS): plan vs baselines",
                        description="Search stage boundaries x worker sets x batch splits for a packed model on a "
                                    "system description (two-level GA; exact DP on small cases), show it beside "
                                    "MARS's half-split, StarONNX's tail fraction, the fastest single worker and "
                                    "greedy by speed, with the simulator's figures; write the plan as JSON. "
                                    "--describe writes this machine's system description.")
    pl.add_argument("name", nargs="?")
    pl.add_argument("--version", type=_version_arg)
    pl.add_argument("--system", help="system description (TOML); see examples/systems/")
    pl.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    pl.add_argument("--time-budget", type=_number_arg(float, above=0), default=60.0,
                    help="seconds the search may take (default 60)")
    pl.add_argument("--batch", type=_count_arg, default=1, help="samples per request, split across a stage's workers")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("-o", "--output", help="plan file (default NAME.plan.json); with --describe, the TOML file")
    pl.add_argument("--plots", help="directory for a Gantt chart and plan-vs-baselines bars (PNG)")
    pl.add_argument("--profile-on", choices=["auto", "daemon", "here"], default="auto",
                    help="where the cpuN kinds are profiled: on the daemon's own worker of N threads, where serve "
                         "mode runs the stages (daemon), in this process pinned alike (here), or the daemon "
                         "when one answers with such workers, else here (auto, the default)")
    pl.add_argument("--describe", action="store_true", help="write this machine's system description")
    pl.add_argument("--workers", help="with --describe: CPU groups as the daemon's `workers` setting ('1,1', '2')")
    pl.set_defaults(func=cmd_place, uses=place_settings)
    cb = sub.add_parser("calibrate", parents=[asks], help="time a model's stages per batch size for batching",
                        description="Serve the model at each batch size, one request at a time, on the daemon's "
                                    "workers; fit LBCI's g(b) and derive N_opt: the largest batch that pays (per-"
                                    "sample time >= 10% below batch 1) and takes at most t_opt/2 (a request may "
                                    "wait for one batch, then run in the next). The table is stored with the "
                                    "model; layer-to-layer batching predicts from it, and max_batch=0 means N_opt. "
                                    "Partition first: the table is per stage.")
    cb.add_argument("name")
    cb.add_argument("--version", type=_version_arg)
    cb.add_argument("--batches", type=_count_arg, nargs="+", default=[1, 2, 4, 8, 16], help="batch sizes to time")
    cb.add_argument("--runs", type=_count_arg, default=5, help="timed requests per batch size (median kept)")
    cb.add_argument("--t-opt-ms", type=_number_arg(float, above=0),
                    help="latency bound; default 5x a batch-1 request's round trip")
    cb.set_defaults(func=cmd_calibrate)
    rm = sub.add_parser("rm", parents=[asks], help="delete a model version from the repository")
    rm.add_argument("name")
    rm.add_argument("--version", type=_version_arg, required=True)
    rm.set_defaults(func=cmd_rm)
    ve = sub.add_parser("verify", parents=[common], help="check every stored file against its checksums",
                        description="Check every file of every version, or of NAME, against the checksums written "
                                    "at add time. With a daemon running, the daemon scrubs its repository and serves "
                                    "again a version it had marked corrupt and now finds intact (after you repaired "
                                    "the file); with none, or with --repository, the repository is read here. "
                                    "Exit status 1 when anything is damaged.")
    ve.add_argument("name", nargs="?")
    ve.set_defaults(func=cmd_verify, uses=CLIENT_SETTINGS + ("repository",))
    pb = sub.add_parser("publish", help="write index.json for a directory of packed models: a remote store",
                        description="Make a directory laid out like a repository (NAME/VERSION/...) usable as "
                                    "a remote store: writes index.json with every file's size and sha256.")
    pb.add_argument("directory")
    pb.set_defaults(func=cmd_publish)
    ev = sub.add_parser("evict", parents=[asks], help="drop a model from memory (it stays on disk), or "
                                                        "demote it from the GPUs (--tier gpu)")
    ev.add_argument("name")
    ev.add_argument("--version", type=_version_arg)
    ev.add_argument("--tier", default="host", type=_tier_arg,
                    help="host (default: every copy in memory), gpu (every GPU), or gpu:UUID / gpu:INDEX")
    ev.set_defaults(func=cmd_evict)
    sta = sub.add_parser("status", parents=[asks], help="one screen: version, uptime, tiers, models, clients")
    sta.set_defaults(func=cmd_status)
    st = sub.add_parser("stats", parents=[asks], help="the daemon's counters, clients, tiers and jobs (JSON)")
    st.set_defaults(func=cmd_stats)

    z = sub.add_parser("zoo", help="build a reference architecture as ONNX with seeded random weights")
    z.add_argument("name", nargs="?")
    z.add_argument("-o", "--output")
    z.add_argument("--seed", type=int, default=0)
    z.add_argument("--list", action="store_true")
    z.set_defaults(func=cmd_zoo)

    dm = sub.add_parser("demo", help="start a daemon, add two zoo models, open them from fresh processes, "
                                     "print open time and warm speed next to plain ORT")
    dm.add_argument("--models", nargs="+", default=["resnet50", "squeezenet1_1"])
    dm.set_defaults(func=cmd_demo)

    from .cluster.cli import add_parser as add_cluster_parser   # (imports Ray only when run)
    add_cluster_parser(sub)

    b = sub.add_parser("bench", help="benchmarks to size or check a deployment on this machine "
                                     "(`modelcache bench --help` lists them)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Benchmarks to run on your own machine; each prints its figures (and with --out\n"
                                   "writes them). Options after the name go to the benchmark "
                                   "(`modelcache bench coldstart --help`).\n\n" +
                                   "\n".join(f"  {name:<12} {line}" for name, line in BENCHMARKS.items()) +
                                   "\n\nThe benchmarks behind design decisions (binding, hashes, transport, ...) and the "
                                   "research\n(FaaS trace sweeps and replays, placement against MARS, cluster routing) live "
                                   "in a\ncheckout's benchmarks/, beside their results (benchmarks/README.md).")
    b.add_argument("which", choices=list(BENCHMARKS))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (try `-- --help`)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)   # (a usage error exits 2 here, with one line: see usage.Parser)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()   # here, not at exit: a reader that went away (`| head`) shows as BrokenPipeError
        return code
    except BrokenPipeError:
        # The reader of our output is gone, which is not our failure: say nothing. Python's docs' recipe:
        # point stdout at devnull, or the interpreter's own flush at exit fails (and prints) again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        return fail(e, debug=_debugging(args))


def _debugging(args) -> bool:
    # The command line asks for tracebacks, not MODELCACHE_LOG_LEVEL: that one is often set for a daemon's log
    # in an environment the CLI shares, and its user still wants one-line errors.
    return getattr(args, "debug", False) or getattr(args, "log_level", None) == "debug"


def fail(e: BaseException, debug: bool = False) -> int:
    """The one place a command's failure becomes what the user reads: one `modelcache: ...` line on stderr
    (the traceback too with --debug), and the exit status 1. Errors we raise on purpose and files the user
    named say what they say; anything else is our bug, and says so."""
    if debug:
        import traceback
        traceback.print_exception(e)
    if isinstance(e, ModelCacheError):
        text = str(e)
    elif isinstance(e, OSError) and e.filename is not None:   # a file the user named, and cannot be read
        text = f"{e.filename}: {e.strerror or e}" + (f" (and {e.filename2})" if e.filename2 else "")
    else:
        text = f"internal error: {type(e).__name__}: {e}" + ("" if debug else " (run with --debug for the traceback)")
    print("modelcache: " + "; ".join(line.strip() for line in text.splitlines() if line.strip()), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
