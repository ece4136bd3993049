"""`modelcache cluster up|status|down`: the cluster mode from the command line (needs the [ray] extra)."""

from __future__ import annotations

import json
import sys

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
        print(f"modelcache: the cluster mode needs the [ray] extra (pip install 'modelcache[ray]'): {e}",
              file=sys.stderr)
        return 1
    ray.init(address=args.address, log_to_driver=False, logging_level="warning")
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
    finally:
        ray.shutdown()
    return 0


def _status_line(row: dict) -> str:
    head = f"node {row['node_id'][:12]}  {row['address']}  pid {row['pid'] or '-'}  restarts {row['restarts']}"
    if not row["up"]:
        return f"{head}  DOWN: {row.get('error', '')}"
    models = "  ".join(f"{tier}: {', '.join(names)}" for tier, names in sorted(row["models"].items())) or "no models"
    return (f"{head}  host {row['host_used'] / 2**20:.0f}/{row['host_capacity'] / 2**20:.0f} MiB  "
            f"in flight {row['in_flight']}  clients {row['clients']}  fetched {row['fetched']}  |  {models}")

