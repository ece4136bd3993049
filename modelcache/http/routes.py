"""The v2 REST endpoints: each parses its request and calls the shared operation (oip/operations.py); errors
become v2's {"error": ...}.

Status codes (oip/operations.py's table): unknown model 404, bad request or tensors 400, a declared body
over max_message_size 413, a model or runtime failure 500, overload or no daemon 503, deadline 504; the
body never carries a trace.
"""

from __future__ import annotations

import json
import logging

from aiohttp import web

from ..errors import ModelCacheError
from ..oip.operations import Operations, parse_version, status_of
from . import codec

log = logging.getLogger("modelcache.http")

OPS = web.AppKey("ops", Operations)
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
        return error(status_of(e)[0], str(e))
    except web.HTTPException as e:   # aiohttp's own: no route, wrong method, a chunked body too large
        if e.status < 400:
            raise
        return too_large(limit) if e.status == 413 else error(e.status, e.reason)
    except Exception as e:
        log.error("internal error on %s %s", request.method, request.path, exc_info=True)
        return error(500, f"internal error: {type(e).__name__}")


def _version(request: web.Request) -> int | None:
    return parse_version(request.match_info.get("version"))


async def live(request: web.Request) -> web.Response:
    return web.Response()   # the front answers: it is live


async def ready(request: web.Request) -> web.Response:
    why = await request.app[OPS].ready()
    return error(400, why) if why else web.Response()   # v2: 200 is true, a 4xx false


async def server_metadata(request: web.Request) -> web.Response:
    return web.json_response(Operations.server_metadata())


async def model_metadata(request: web.Request) -> web.Response:
    return web.json_response(await request.app[OPS].model_metadata(request.match_info["name"], _version(request)))


async def model_ready(request: web.Request) -> web.Response:
    why = await request.app[OPS].model_ready(request.match_info["name"], _version(request))   # 404 if unknown
    return error(400, why) if why else web.Response()   # v2: 200 is ready, a 4xx not (Triton answers 400)


async def infer(request: web.Request) -> web.Response:
    name, version = request.match_info["name"], _version(request)
    ops = request.app[OPS]
    why = ops.why_unloaded(name)
    if why:   # before reading the body
        return error(400, why)
    body = await request.read()
    req = codec.decode_request(body, request.headers.get("Inference-Header-Content-Length"))
    outputs, ran = await ops.infer(name, version, req.feeds, req.output_names, req.timeout_us, req.classes,
                                   req.sequence)
    order = req.output_names if req.output_names is not None else list(outputs)
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
    return web.json_response(await request.app[OPS].repository_index(only_ready))


async def repository_load(request: web.Request) -> web.Response:
    params = (await _json_body(request)).get("parameters") or {}
    if not isinstance(params, dict):
        raise web.HTTPBadRequest(reason="load's parameters must be a JSON object")
    await request.app[OPS].load(request.match_info["name"], params)
    return web.Response()


async def repository_unload(request: web.Request) -> web.Response:
    await _json_body(request)   # (unload_dependents: there are none)
    await request.app[OPS].unload(request.match_info["name"])
    return web.Response()


async def model_config(request: web.Request) -> web.Response:
    """Triton's model configuration extension, as its config.pbtxt would say it in JSON."""
    return web.json_response(await request.app[OPS].model_config(request.match_info["name"], _version(request)))


async def model_stats(request: web.Request) -> web.Response:
    """Triton's statistics extension: every model, every version of one, or one version."""
    entries = await request.app[OPS].model_stats(request.match_info.get("name"), _version(request))
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
