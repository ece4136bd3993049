"""The v2 REST endpoints: each parses its request and calls the shared operation (oip/operations.py); errors
become v2's {"error": ...}.

Status codes (oip/operations.py's table): unknown model 404, bad request or tensors 400, a declared body
over max_message_size 413, a model or runtime failure 500, overload or no daemon 503, deadline 504; no route
404, a route's wrong method 405 (with Allow); the body never carries a trace.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from urllib.parse import unquote

import httptools

from ..errors import InputError, ModelCacheError
from ..oip.operations import Operations, parse_version, status_of
from ..oip.shared_memory import CUDA_REFUSED
from ..wire.tensors import INLINE_MAX_BYTES
from . import codec
from .http1 import Request, Response

log = logging.getLogger("modelcache.http")


class HttpError(Exception):
    """A request this front refuses as HTTP (no route, wrong method): its status and words."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers


def _file_bytes(key: str, value) -> bytes:
    """A repository load's `file:` parameter: its content, base64 in JSON (as Triton's HTTP front reads it)."""
    if not isinstance(value, str):
        raise InputError(f"load parameter '{key}' must be a base64 string of the file's bytes")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as e:
        raise InputError(f"load parameter '{key}' is not base64: {e}") from None


def json_response(doc, status: int = 200) -> Response:
    return Response(status, json.dumps(doc).encode(), "application/json")


def error(status: int, message: str) -> Response:
    return json_response({"error": message}, status)


def too_large(limit: int, size: int | None = None) -> Response:
    said = f"declares {size} bytes" if size is not None else "is larger"
    return error(413, f"the request body {said}; the limit is {limit} bytes (max_message_size): send less, "
                      "or raise max_message_size")


OK = Response()


class Router:
    """Path patterns ("/v2/models/{name}") -> a handler per method; GET routes answer HEAD too."""

    def __init__(self):
        self.routes: list[tuple[re.Pattern, dict]] = []

    def add(self, method: str, pattern: str, handler) -> None:
        regex = re.compile("^" + re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern) + "$")
        for known, methods in self.routes:
            if known.pattern == regex.pattern:
                methods[method] = handler
                return
        self.routes.append((regex, {method: handler}))

    def resolve(self, method: str, path: str):
        """(handler, the path's captures, percent-decoded) or HttpError 404 / 405."""
        for regex, methods in self.routes:
            m = regex.match(path)
            if m is None:
                continue
            handler = methods.get("GET" if method == "HEAD" else method)
            if handler is None:
                allowed = ", ".join(sorted(methods))
                raise HttpError(405, f"{method} is not allowed on {path}: use {allowed}", {"Allow": allowed})
            return handler, {k: unquote(v) for k, v in m.groupdict().items()}
        raise HttpError(404, f"no endpoint {path}: the Open Inference Protocol's are under /v2")


class Endpoints:
    """The v2 endpoints over one front's operations; `handle` is the HTTP server's handler."""

    def __init__(self, ops: Operations):
        self.ops = ops
        self.router = Router()
        model, versioned = "/v2/models/{name}", "/v2/models/{name}/versions/{version}"
        self.router.add("GET", "/v2/health/live", self.live)
        self.router.add("GET", "/v2/health/ready", self.ready)
        self.router.add("GET", "/v2", self.server_metadata)
        self.router.add("GET", "/v2/models/stats", self.model_stats)   # before {name}: every model's stats
        for base in (model, versioned):
            self.router.add("GET", base, self.model_metadata)
            self.router.add("GET", base + "/ready", self.model_ready)
            self.router.add("GET", base + "/config", self.model_config)
            self.router.add("GET", base + "/stats", self.model_stats)
            self.router.add("POST", base + "/infer", self.infer)
        self.router.add("GET", "/v2/logging", self.logging)
        self.router.add("POST", "/v2/logging", self.logging)
        self.router.add("POST", "/v2/repository/index", self.repository_index)
        self.router.add("POST", "/v2/repository/models/{name}/load", self.repository_load)
        self.router.add("POST", "/v2/repository/models/{name}/unload", self.repository_unload)
        shm = "/v2/systemsharedmemory"
        self.router.add("GET", shm + "/status", self.shm_status)
        self.router.add("GET", shm + "/region/{region}/status", self.shm_status)
        self.router.add("POST", shm + "/region/{region}/register", self.shm_register)
        self.router.add("POST", shm + "/unregister", self.shm_unregister)
        self.router.add("POST", shm + "/region/{region}/unregister", self.shm_unregister)
        # CUDA shared memory: none is ever registered (GPU regions are not served); status and unregister answer
        # as for an empty registry, so that clients which clear both kinds first (Triton's examples) go on.
        cuda = "/v2/cudasharedmemory"
        for route in (cuda + "/status", cuda + "/region/{region}/status"):
            self.router.add("GET", route, self.cuda_status)
        for route in (cuda + "/unregister", cuda + "/region/{region}/unregister"):
            self.router.add("POST", route, self.cuda_unregister)
        self.router.add("POST", cuda + "/region/{region}/register", self.cuda_register)

    def receive_into(self, method: str, target: bytes, headers: dict, length: int):
        """Where the HTTP server reads a body into (http1.ReceiveInto): an infer body with binary tensors large enough
        that one of them could pass to the daemon in a memory file goes straight into one of the link's, placed so
        that its binary part starts aligned (client/input_buffers.Received); any other body is collected as bytes."""
        head = headers.get("inference-header-content-length")
        if (method != "POST" or length <= INLINE_MAX_BYTES or head is None
                or not target.partition(b"?")[0].endswith(b"/infer")):
            return None
        at = int(head) if head.isascii() and head.isdigit() and len(head) < 19 else 0   # (a bad one: the route says)
        return self.ops.link.buffers.receive(length, at)

    async def handle(self, request: Request) -> Response:
        """Every failure as v2's {"error": ...}: typed ones with their status, the rest 500 without a trace."""
        try:
            try:
                path = httptools.parse_url(request.target).path.decode("latin-1")
            except httptools.HttpParserInvalidURLError:
                raise HttpError(400, f"the request target {request.target[:80]!r} is not a URL") from None
            handler, request.params = self.router.resolve(request.method, path)
            return await handler(request)
        except ModelCacheError as e:
            return error(status_of(e)[0], str(e))
        except HttpError as e:
            response = error(e.status, str(e))
            response.headers = e.headers
            return response
        except Exception as e:
            log.error("internal error on %s %r", request.method, request.target[:200], exc_info=True)
            return error(500, f"internal error: {type(e).__name__}")

    @staticmethod
    def _version(request: Request) -> int | None:
        return parse_version(request.params.get("version"))

    async def live(self, request: Request) -> Response:
        return OK   # the front answers: it is live

    async def ready(self, request: Request) -> Response:
        why = await self.ops.ready()
        return error(400, why) if why else OK   # v2: 200 is true, a 4xx false

    async def server_metadata(self, request: Request) -> Response:
        return json_response(self.ops.server_metadata())

    async def model_metadata(self, request: Request) -> Response:
        return json_response(await self.ops.model_metadata(request.params["name"], self._version(request)))

    async def model_ready(self, request: Request) -> Response:
        why = await self.ops.model_ready(request.params["name"], self._version(request))   # 404 if unknown
        return error(400, why) if why else OK   # v2: 200 is ready, a 4xx not (Triton answers 400)

    async def infer(self, request: Request) -> Response:
        name, version = request.params["name"], self._version(request)
        req = codec.decode_request(request.body, request.headers.get("inference-header-content-length"))
        outputs, ran = await self.ops.infer(name, version, req.feeds, req.output_names, req.timeout_us,
                                            req.classes, req.sequence, priority=req.priority, body=request.received)
        order = req.output_names if req.output_names is not None else list(outputs)
        in_regions = self.ops.write_outputs(outputs, req.output_regions)
        payload, head_len = codec.encode_response(name, ran, req.id, outputs, order, req.binary_outputs,
                                                  req.binary_default, in_regions)
        if head_len is None:
            return Response(200, payload, "application/json")
        return Response(200, payload, "application/octet-stream", {"Inference-Header-Content-Length": str(head_len)})

    @staticmethod
    def _json_body(request: Request) -> dict:
        if not request.body.strip():
            return {}
        try:
            doc = json.loads(request.body)
        except (ValueError, UnicodeDecodeError) as e:
            raise InputError(f"the request body is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise InputError("the request body must be a JSON object")
        return doc

    async def repository_index(self, request: Request) -> Response:
        only_ready = bool(self._json_body(request).get("ready", False))
        return json_response(await self.ops.repository_index(only_ready))

    async def repository_load(self, request: Request) -> Response:
        params = self._json_body(request).get("parameters") or {}
        if not isinstance(params, dict):
            raise InputError("load's parameters must be a JSON object")
        await self.ops.load(request.params["name"], {k: _file_bytes(k, v) if k.startswith("file:") else v
                                                     for k, v in params.items()})
        return OK

    async def repository_unload(self, request: Request) -> Response:
        self._json_body(request)   # (unload_dependents: there are none)
        await self.ops.unload(request.params["name"])
        return OK

    async def model_config(self, request: Request) -> Response:
        """Triton's model configuration extension, as its config.pbtxt would say it in JSON."""
        return json_response(await self.ops.model_config(request.params["name"], self._version(request)))

    async def model_stats(self, request: Request) -> Response:
        """Triton's statistics extension: every model, every version of one, or one version."""
        entries = await self.ops.model_stats(request.params.get("name"), self._version(request))
        return json_response({"model_stats": entries})

    async def shm_status(self, request: Request) -> Response:
        """Triton's system shared-memory extension (oip/shared_memory.py): every region, or one (404 if unknown)."""
        return json_response(self.ops.regions.status(request.params.get("region")))

    async def shm_register(self, request: Request) -> Response:
        doc = self._json_body(request)
        self.ops.regions.register(request.params["region"], doc.get("key"), doc.get("offset", 0),
                                  doc.get("byte_size"))
        return OK

    async def shm_unregister(self, request: Request) -> Response:
        self.ops.regions.unregister(request.params.get("region"))
        return OK

    async def logging(self, request: Request) -> Response:
        """Triton's logging extension: GET the settings, POST some of them (an empty body changes nothing)."""
        return json_response(await self.ops.log_settings(self._json_body(request) if request.method == "POST" else {}))

    async def cuda_status(self, request: Request) -> Response:
        region = request.params.get("region")
        if region:
            return error(404, f"Unable to find cuda shared memory region: '{region}'")
        return json_response([])

    async def cuda_unregister(self, request: Request) -> Response:
        return OK

    async def cuda_register(self, request: Request) -> Response:
        return error(400, CUDA_REFUSED)
