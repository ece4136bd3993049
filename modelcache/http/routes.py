"""The v2 endpoints: each maps onto daemon messages (see link.py), errors onto v2's {"error": ...}.

Health, server and model metadata, model readiness, infer, and Triton's extensions that its clients
call: model repository (index, load = prefetch into the host tier, unload = evict from memory),
model configuration and statistics. A model in the repository is ready (the daemon promotes it on
its first request) unless this front unloaded it: then it is not ready and refuses requests until it
is loaded again, as Triton's explicit model control. Status codes: unknown model 404, bad request or
tensors 400, a declared body over max_message_size 413, a model or runtime failure 500, overload or
no daemon 503, deadline 504; the body never carries a trace.
"""

from __future__ import annotations

import json
import logging
import os
import time

from aiohttp import web

from .. import __version__, protocol as P, tensors
from ..errors import ModelCacheError
from . import codec
from .link import DaemonLink

log = logging.getLogger("modelcache.http")

EXTENSIONS = ["binary_tensor_data", "model_repository", "model_configuration", "statistics"]
# The daemon's error codes (modelcache/errors.py) -> HTTP status; any other code (a RunError's "run") is a 500
STATUS_BY_CODE = {"not_found": 404, "input": 400, "protocol": 400, "permission": 403, "capacity": 503,
                  "daemon_unavailable": 503, "timeout": 504, "run": 500}
LINK = web.AppKey("link", DaemonLink)
SETTINGS = web.AppKey("settings", object)
UNLOADED = web.AppKey("unloaded", set)   # names this front unloaded: not ready until loaded again
MAX_BODY = web.AppKey("max_body", int)   # max_message_size in bytes, as aiohttp's client_max_size


def too_large(limit: int, size: int | None = None) -> web.Response:
    said = f"declares {size} bytes" if size is not None else "is larger"
    return error(413, f"the request body {said}; the limit is {limit} bytes (max_message_size): send less, "
                      "or raise max_message_size")


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def v2_errors(request: web.Request, handler):
    """Every failure as v2's {"error": ...}: typed ones with their status, the rest 500 without a trace.

    A body declared over the limit is refused before it is read: aiohttp enforces client_max_size only
    as the body arrives, so a client that declared 16 GiB and sent less would wait for the rest."""
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        response = too_large(limit, request.content_length)
        response.force_close()   # the unread body is not drained: the connection goes
        return response
    try:
        return await handler(request)
    except ModelCacheError as e:
        return error(STATUS_BY_CODE.get(e.code, 500), str(e))
    except web.HTTPException as e:   # aiohttp's own: no route, wrong method, a chunked body too large
        if e.status < 400:
            raise
        return too_large(limit) if e.status == 413 else error(e.status, e.reason)
    except Exception as e:
        log.error("internal error on %s %s", request.method, request.path, exc_info=True)
        return error(500, f"internal error: {type(e).__name__}")


def _version(request: web.Request) -> int | None:
    v = request.match_info.get("version")
    if v is None or v == "":
        return None
    try:
        version = int(v)
    except ValueError:
        raise web.HTTPBadRequest(reason=f"model version {v[:40]!r} is not a number") from None
    if version < 1:
        raise web.HTTPBadRequest(reason=f"model version {version}: versions start at 1")
    return version


async def live(request: web.Request) -> web.Response:
    return web.Response()   # the front answers: it is live


async def ready(request: web.Request) -> web.Response:
    try:
        await request.app[LINK].call(P.ListModels(req_id=0), (P.ModelList,), timeout_s=5.0)
    except ModelCacheError as e:
        return error(400, f"not ready: {e}")   # v2: 200 is true, a 4xx false
    return web.Response()


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response({"name": "modelcache", "version": __version__, "extensions": EXTENSIONS})


async def model_metadata(request: web.Request) -> web.Response:
    name, link = request.match_info["name"], request.app[LINK]
    d = await link.call(P.Describe(req_id=0, name=name, version=_version(request)), (P.DescribeReply,))
    listing = await link.call(P.ListModels(req_id=0), (P.ModelList,))
    versions = sorted({m["version"] for m in listing.models if m["name"] == name} | {d.version})
    return web.json_response({"name": d.name, "versions": [str(v) for v in versions], "platform": "onnxruntime_onnx",
                              "inputs": codec.tensor_metadata(d.inputs), "outputs": codec.tensor_metadata(d.outputs)})


def _unloaded(request: web.Request, name: str) -> str | None:
    """Why the model is not ready, when this front unloaded it."""
    if name in request.app[UNLOADED]:
        return f"{name} is unloaded: load it first (POST /v2/repository/models/{name}/load)"
    return None


async def model_ready(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    version = _version(request)
    await request.app[LINK].call(P.Describe(req_id=0, name=name, version=version), (P.DescribeReply,))  # 404 if unknown
    why = _unloaded(request, name)
    if why:
        return error(400, why)   # v2: 200 is ready, a 4xx not (Triton answers 400)
    listing = await request.app[LINK].call(P.ListModels(req_id=0), (P.ModelList,))
    for m in listing.models:
        if m["name"] == name and (version is None or m["version"] == version) and m.get("corrupt"):
            return error(400, f"{name}@{m['version']} is damaged: {m['corrupt']}")
    return web.Response()


async def infer(request: web.Request) -> web.Response:
    name, version = request.match_info["name"], _version(request)
    why = _unloaded(request, name)
    if why:
        return error(400, why)
    body = await request.read()
    req = codec.decode_request(body, request.headers.get("Inference-Header-Content-Length"))
    # Big inputs go through /dev/shm files as client.infer sends them; the daemon's group may read them.
    settings = request.app[SETTINGS]
    group_of = settings.socket[len("ipc://"):]
    wire, files = tensors.encode(req.feeds, group_of=group_of, model=name)
    try:
        deadline_ms = req.timeout_us / 1000 if req.timeout_us else None
        reply = await request.app[LINK].call(
            P.Infer(req_id=0, client_id="", name=name, inputs=wire, version=version,
                    output_names=req.output_names, deadline_ms=deadline_ms), (P.InferReply,))
    finally:
        for f in files:
            os.unlink(f)
    outputs, _ = tensors.decode(reply.outputs)
    order = req.output_names if req.output_names is not None else list(outputs)
    ran = reply.version if reply.version is not None else version   # (a daemon from before the field: None)
    payload, head_len = codec.encode_response(name, ran, req.id, outputs, order, req.binary_outputs,
                                              req.binary_default)
    if head_len is None:
        return web.Response(body=payload, content_type="application/json")
    return web.Response(body=payload, content_type="application/octet-stream",
                        headers={"Inference-Header-Content-Length": str(head_len)})


async def _json_body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise web.HTTPBadRequest(reason=f"the request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise web.HTTPBadRequest(reason="the request body must be a JSON object")
    return doc


async def repository_index(request: web.Request) -> web.Response:
    only_ready = bool((await _json_body(request)).get("ready", False))
    listing = await request.app[LINK].call(P.ListModels(req_id=0), (P.ModelList,))
    index = []
    for m in listing.models:
        if m.get("corrupt"):
            state, reason = "UNAVAILABLE", f"damaged: {m['corrupt']}"
        elif m["name"] in request.app[UNLOADED]:
            state, reason = "UNAVAILABLE", "unloaded"
        else:   # every stored version serves; the tier says how soon
            state, reason = "READY", ("in memory" if m["tier"] != "disk" else "on disk: promoted on first request")
        if not only_ready or state == "READY":
            index.append({"name": m["name"], "version": str(m["version"]), "state": state, "reason": reason})
    return web.json_response(index)


async def repository_load(request: web.Request) -> web.Response:
    params = (await _json_body(request)).get("parameters") or {}
    if not isinstance(params, dict) or any(k == "config" or k.startswith("file:") for k in params):
        raise web.HTTPBadRequest(reason="load takes no config or files here: add models with `modelcache add`")
    settings = request.app[SETTINGS]
    name = request.match_info["name"]
    await request.app[LINK].call(P.Load(req_id=0, name=name), (P.Ack,), timeout_s=settings.add_timeout_s)
    request.app[UNLOADED].discard(name)
    return web.Response()


async def repository_unload(request: web.Request) -> web.Response:
    await _json_body(request)   # (unload_dependents: there are none)
    name = request.match_info["name"]
    link = request.app[LINK]
    # Every version in memory goes: an Evict without a version names only the latest, and a model
    # the front calls unloaded must not keep an older version resident.
    listing = await link.call(P.ListModels(req_id=0), (P.ModelList,))
    resident = [m["version"] for m in listing.models if m["name"] == name and m["tier"] != "disk"]
    for version in resident or [None]:   # none resident: still one Evict, so an unknown name is a 404
        await link.call(P.Evict(req_id=0, name=name, version=version), (P.Ack,))
    request.app[UNLOADED].add(name)
    return web.Response()


async def model_config(request: web.Request) -> web.Response:
    """Triton's model configuration extension, as its config.pbtxt would say it in JSON."""
    d = await request.app[LINK].call(P.Describe(req_id=0, name=request.match_info["name"],
                                                version=_version(request)), (P.DescribeReply,))
    return web.json_response(codec.model_config(d.name, d.inputs, d.outputs))


async def model_stats(request: web.Request) -> web.Response:
    """Triton's statistics extension: every model, every version of one, or one version."""
    name, version = request.match_info.get("name"), _version(request)
    link = request.app[LINK]
    if name is not None:   # 404 for an unknown model or version
        await link.call(P.Describe(req_id=0, name=name, version=version), (P.DescribeReply,))
    listing = await link.call(P.ListModels(req_id=0), (P.ModelList,))
    stats = await link.call(P.Stats(req_id=0), (P.StatsReply,))
    served = stats.executor.get("models") or {}
    now_ms = time.time() * 1e3
    entries = [codec.model_stat(m["name"], m["version"], served.get(f"{m['name']}@{m['version']}"), now_ms)
               for m in listing.models
               if (name is None or m["name"] == name) and (version is None or m["version"] == version)]
    return web.json_response({"model_stats": entries})


def add_routes(app: web.Application) -> None:
    model = "/v2/models/{name}"
    versioned = "/v2/models/{name}/versions/{version}"
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2", server_metadata)
    app.router.add_get("/v2/models/stats", model_stats)   # before {name}: Triton's URL for every model's stats
    for base in (model, versioned):
        app.router.add_get(base, model_metadata)
        app.router.add_get(base + "/ready", model_ready)
        app.router.add_get(base + "/config", model_config)
        app.router.add_get(base + "/stats", model_stats)
        app.router.add_post(base + "/infer", infer)
    app.router.add_post("/v2/repository/index", repository_index)
    app.router.add_post("/v2/repository/models/{name}/load", repository_load)
    app.router.add_post("/v2/repository/models/{name}/unload", repository_unload)
