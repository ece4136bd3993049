"""`modelcache cluster up|status|down`: the cluster mode from the command line (needs the [ray] extra)."""

from __future__ import annotations

import json
import socket

from ..errors import ModelCacheError

DAEMON_FLAGS = ("socket", "repository", "remote", "host_capacity", "workers")


def add_parser(sub) -> None:
    c = sub.add_parser("cluster", help="run modelcache on a Ray cluster: a daemon per node, requests routed to "
                                       "the node where the model is warm ([ray] extra)",
                       description="On a running Ray cluster (`ray start --head` on one machine, `ray start "
                                   "--address=HEAD:6379` on the others): `up` adopts each node's modelcache "
                                   "daemon (the systemd unit's) or starts one per node with the given settings, "
                                   "and runs a Ray Serve app with one replica per node whose router sends each "
                                   "request to the replica whose node opens its model soonest. `status` shows "
                                   "each node's models by tier and load; `down` removes the app and stops the "
                                   "daemons `up` started.")
    verbs = c.add_subparsers(dest="verb", required=True)
    for verb, text in (("up", "start a daemon on every node (or adopt the node's) and deploy the Serve app"),
                       ("status", "per node: its daemon, models by tier, load"),
                       ("down", "delete the Serve app, stop the daemons `up` started")):
        v = verbs.add_parser(verb, help=text)
        v.add_argument("--address", default="auto", help="the Ray cluster (default: auto, the one this node is in)")
        if verb == "up":
            v.add_argument("--router", choices=["locality", "default"], default="locality",
                           help="locality: by where each model is warm (default); default: Ray Serve's own")
            for flag in DAEMON_FLAGS:
                v.add_argument(f"--{flag.replace('_', '-')}",
                               help=f"for daemons this starts: the {flag} setting (default: the daemon's)")
        if verb == "status":
            v.add_argument("--json", action="store_true", help="the rows as JSON")
    c.set_defaults(func=cmd_cluster)


def cmd_cluster(args) -> int:
    try:
        import ray
        from . import rayserve
    except ImportError as e:
        raise ModelCacheError(f"the cluster mode needs the [ray] extra (pip install 'modelcache[ray]'): {e}") from None
    connect_ray(ray, args.address)
    try:
        if args.verb == "up":
            settings = {k: getattr(args, k) for k in DAEMON_FLAGS if getattr(args, k)}
            infos = rayserve.start_daemons(settings)
            rayserve.deploy(router=args.router, replicas=len(infos))
            for info in infos:
                how = "started" if info["owned"] else "adopted"
                print(f"node {info['node_id'][:12]}  daemon {how} at {info['address']}")
            print(f"app {rayserve.APP_NAME!r}: {len(infos)} replicas, {args.router} routing")
        elif args.verb == "status":
            rows = rayserve.cluster_status()
            if args.json:
                print(json.dumps(rows, indent=2))
            for row in [] if args.json else rows:
                print(_status_line(row))
            if not rows:
                print("no modelcache daemons on this cluster: run `modelcache cluster up`")
        else:
            from ray import serve
            serve.delete(rayserve.APP_NAME)
            print(f"app deleted; {rayserve.stop_daemons()} daemon actors stopped")
    except ray.exceptions.RayError as e:   # an actor's failure: its own error, as one line
        raise ModelCacheError(_ray_failure(e)) from None
    finally:
        ray.shutdown()
    return 0


def connect_ray(ray, address: str) -> None:
    """ray.init, or one line saying there is no cluster there and how to get one. An explicit HOST:PORT is
    tried first with a plain connect: Ray itself retries an unreachable address for a minute or more."""
    fix = "start one with `ray start --head`, or pass --address HEAD:6379"
    if address not in ("auto", "local") and "://" not in address:
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()
        except (OSError, ValueError) as e:
            reason = "not HOST:PORT" if isinstance(e, ValueError) else e.strerror or str(e) or "timed out"
            raise ModelCacheError(f"no Ray cluster at {address} ({reason}): {fix}") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="warning")
    except ConnectionError:
        raise ModelCacheError(f"no Ray cluster at {address}: {fix}") from None


def _ray_failure(e) -> str:
    """What went wrong on the cluster: the cause's own message (ours are one line), else Ray's last line."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, ModelCacheError):
        return str(cause)
    lines = [line.strip() for line in str(cause or e).splitlines() if line.strip()]
    return f"on the Ray cluster: {lines[-1] if lines else type(e).__name__}"


def _status_line(row: dict) -> str:
    head = f"node {row['node_id'][:12]}  {row['address']}  pid {row['pid'] or '-'}  restarts {row['restarts']}"
    if not row["up"]:
        return f"{head}  DOWN: {row.get('error', '')}"
    models = "  ".join(f"{tier}: {', '.join(names)}" for tier, names in sorted(row["models"].items())) or "no models"
    return (f"{head}  host {row['host_used'] / 2**20:.0f}/{row['host_capacity'] / 2**20:.0f} MiB  "
            f"in flight {row['in_flight']}  clients {row['clients']}  fetched {row['fetched']}  |  {models}")

