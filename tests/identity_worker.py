"""A client process for tests/test_identity.py, run as another user: connect, then try each action.

    identity_worker.py UID GID GROUPS SOCKET ACTIONS_JSON      (started as root; GROUPS: "0,5" or "")

It starts as root and becomes UID/GID/GROUPS before it connects: subprocess's user= would
switch before exec, and here the interpreter lives under /root (0700), which no other user
may enter. So everything it will import is imported first, while root may still read it.
The kernel then names the new user on every socket it connects, which is what the test needs.

ACTIONS_JSON is a list of [label, kind, *args]: kind "call" runs Client.<args[0]>(*args[1:]);
"raw" sends protocol.<args[0]>(**args[1]) (with req_id) and expects an Ack; "session" opens a drop-in
InferenceSession on model args[0] (its lease's files as descriptors); "stats" lists
the client ids `stats` shows. Prints one JSON object: label -> {"ok": result} or
{"error": exception class, "errno": errno or null, "message": text}, and "connect" with
how long connecting took ("ms") and its error, if any.
"""

import json
import os
import sys
import time


def become(uid: int, gid: int, groups: list[int]) -> None:
    import grp  # noqa: F401  (the client names the socket's group in its permission error)
    import onnx  # noqa: F401  (add parses the model to find its external data)
    import zmq.utils.monitor  # noqa: F401
    import modelcache.client.connection  # noqa: F401  (the client itself: connect runs after the switch,
    import modelcache.config  # noqa: F401             and reads the settings then)
    import modelcache.store.packing  # noqa: F401
    import modelcache.store.sources  # noqa: F401
    import numpy  # noqa: F401
    import onnxruntime  # noqa: F401
    import modelcache.client.leases  # noqa: F401  (a drop-in session's: "session" below)
    import modelcache.client.session  # noqa: F401
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)


def main() -> int:
    import modelcache
    from modelcache.errors import from_code
    from modelcache.wire import protocol as P

    uid, gid, groups = int(sys.argv[1]), int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",") if g]
    socket, actions = sys.argv[4], json.loads(sys.argv[5])
    become(uid, gid, groups)
    out = {}
    t0 = time.perf_counter()
    try:
        client = modelcache.connect(socket)
    except Exception as e:
        out["connect"] = {"error": type(e).__name__, "message": str(e), "ms": (time.perf_counter() - t0) * 1e3}
        print(json.dumps(out))
        return 0
    out["connect"] = {"ok": client.client_id, "ms": (time.perf_counter() - t0) * 1e3}
    for label, kind, *args in actions:
        try:
            if kind == "call":
                result = getattr(client, args[0])(*args[1:])
                result = result.to_dict() if hasattr(result, "to_dict") else result
            elif kind == "raw":  # below _call, which would address the message to our own client id
                msg = getattr(P, args[0])(req_id=0, **args[1])
                reply = client._zmq.exchange(msg, (P.Ack,), 10)   # the request core, as msg is
                if isinstance(reply, P.ErrorReply):
                    raise from_code(reply.code, reply.message)
                result = reply.to_dict()
            elif kind == "session":   # a drop-in session: its lease's files come as descriptors, over the lane
                with modelcache.InferenceSession(args[0], socket=socket) as s:
                    result = {"hit": s.was_cache_hit, "inputs": [i.name for i in s.get_inputs()]}
            else:  # stats
                result = [c["client_id"] for c in client.stats().clients]
            out[label] = {"ok": result}
        except Exception as e:
            out[label] = {"error": type(e).__name__, "errno": getattr(e, "errno", None), "message": str(e)}
    client.close()
    print(json.dumps(out, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
