"""The least Python can cost a tiny request: one process, ONNX Runtime inline, each server library bare.

    python benchmarks/grpc/floor.py [--servers raw-http aiohttp grpc-sync grpc-aio] [--clients 1 4]
                                    [--seconds 3] [--rounds 3] [--out benchmarks/grpc/floor]

Issue 46 asks whether a Python server can come near Triton's C++ one on a tiny model. Each server here runs
tiny-cnn on one ORT session in its own process (one intra-op thread, not spinning, run on the thread that
handles the request) and does nothing else: no daemon, no lane, no checks beyond parsing, answers encoded by
hand. What is left is the server library's own cost per request and ORT's run, the floor under any design in
that library:

  raw-http    asyncio.Protocol parsing HTTP/1.1 and v2's binary tensor extension by hand (keep-alive only;
              not a server anyone should run: the floor of Python's event loop and sockets)
  aiohttp     aiohttp's web server, one route (what `modelcache http` runs)
  grpc-sync   grpc.server with one worker thread, Triton's ModelInfer
  grpc-aio    grpc.aio.server, the same (what `modelcache grpc` runs)
  h2-grpc     gRPC's unary call over h2 (pure-Python HTTP/2) on an asyncio.Protocol, no grpcio

The load is run.py's: tritonclient's infer (HTTP with binary tensors, or gRPC), batch 1, N client processes
in a closed loop, the servers alternating round by round, and the CPU time (/proc) each request cost the
server and the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SERVERS = ("raw-http", "aiohttp", "grpc-sync", "grpc-aio")
UVLOOP = ("raw-http-uvloop", "aiohttp-uvloop")   # the same on uvloop's event loop (libuv), where it is installed
EXTRA = ("httptools", "h2-grpc")                  # where httptools / h2 are installed (pip install httptools h2)


def _session(path: str):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sess, sess.get_inputs()[0].name, sess.get_outputs()[0].name


def _v2_infer(sess, iname: str, oname: str, header: bytes, binary: bytes) -> tuple[bytes, bytes]:
    """A v2 binary-extension request's JSON header and tensor bytes -> the reply's (header, tensor bytes)."""
    import numpy as np
    inp = json.loads(header)["inputs"][0]
    y = sess.run([oname], {iname: np.frombuffer(binary, np.float32).reshape(inp["shape"])})[0]
    data = y.tobytes()
    return json.dumps({"model_name": "tiny-cnn", "outputs": [
        {"name": oname, "datatype": "FP32", "shape": list(y.shape), "parameters": {"binary_data_size": len(data)}}]
    }).encode(), data


def serve_raw_http(sess, iname, oname, port: int) -> None:
    class V2(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buf = transport, b""

        def data_received(self, data):
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                lines = self.buf[:end].decode("latin-1").split("\r\n")
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                n = int(headers.get("content-length", 0))
                if len(self.buf) < end + 4 + n:
                    return
                body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
                _answer(self.transport, sess, iname, oname, lines[0].startswith("GET"), body,
                        headers.get("inference-header-content-length"))

    _listen(V2, port)


def serve_httptools(sess, iname, oname, port: int) -> None:
    import httptools

    class V2(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.parser = httptools.HttpRequestParser(self)
            self.headers, self.body = {}, []

        def data_received(self, data):
            self.parser.feed_data(data)

        # httptools' callbacks, as llhttp parses
        def on_header(self, name: bytes, value: bytes):
            self.headers[name.lower()] = value

        def on_body(self, body: bytes):
            self.body.append(body)

        def on_message_complete(self):
            body, headers = b"".join(self.body), self.headers
            self.headers, self.body = {}, []
            _answer(self.transport, sess, iname, oname, self.parser.get_method() == b"GET", body,
                    headers.get(b"inference-header-content-length"))

    _listen(V2, port)


def _answer(transport, sess, iname, oname, get: bool, body: bytes, header_length) -> None:
    """A hand-written response: 200 to a GET (health), the v2 binary reply to an infer."""
    if get:
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        return
    split = int(header_length) if header_length is not None else len(body)
    head, data = _v2_infer(sess, iname, oname, body[:split], body[split:])
    transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n"
                    % (len(head), len(head) + len(data)) + head + data)


def _listen(protocol, port: int) -> None:
    async def main():
        await asyncio.get_running_loop().create_server(protocol, "127.0.0.1", port)
        print("READY", flush=True)
        await asyncio.Event().wait()
    _run(main())


def _run(main) -> None:
    """asyncio's loop, or uvloop's where the server's name asks for it (UVLOOP_ON, set by _serve)."""
    if UVLOOP_ON:
        import uvloop
        uvloop.run(main)
    else:
        asyncio.run(main)


UVLOOP_ON = False


def serve_aiohttp(sess, iname, oname, port: int) -> None:
    from aiohttp import web

    async def infer(request):
        body = await request.read()
        split = int(request.headers.get("Inference-Header-Content-Length", len(body)))
        head, data = _v2_infer(sess, iname, oname, body[:split], body[split:])
        return web.Response(body=head + data, headers={"Inference-Header-Content-Length": str(len(head)),
                                                       "Content-Type": "application/octet-stream"})

    async def ready(request):
        return web.Response()

    app = web.Application()
    app.router.add_post("/v2/models/{name}/infer", infer)
    app.router.add_get("/v2/health/ready", ready)

    async def main():
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print("READY", flush=True)
        await asyncio.Event().wait()
    _run(main())


def _grpc_infer(sess, iname, oname, request):
    """Triton's ModelInferRequest -> its ModelInferResponse, tiny-cnn run inline."""
    import numpy as np
    from modelcache.triton_protos import grpc_service_pb2 as pb
    y = sess.run([oname], {iname: np.frombuffer(request.raw_input_contents[0], np.float32)
                           .reshape(list(request.inputs[0].shape))})[0]
    reply = pb.ModelInferResponse(model_name=request.model_name)
    out = reply.outputs.add()
    out.name, out.datatype = oname, "FP32"
    out.shape.extend(y.shape)
    reply.raw_output_contents.append(y.tobytes())
    return reply


def serve_grpc(sess, iname, oname, port: int, aio: bool) -> None:
    import grpc
    from modelcache.grpc.handlers import method_handlers
    from modelcache.triton_protos import grpc_service_pb2 as pb
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]

    def model_infer(request):
        return _grpc_infer(sess, iname, oname, request)

    class Sync:
        def ModelInfer(self, request, context):
            return model_infer(request)

    class Aio:
        async def ModelInfer(self, request, context):
            return model_infer(request)

    handler = grpc.method_handlers_generic_handler(service.full_name, method_handlers(service, Aio() if aio else Sync()))
    if not aio:
        from concurrent import futures
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("READY", flush=True)
        server.wait_for_termination()
        return

    async def main():
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("READY", flush=True)
        await server.wait_for_termination()
    asyncio.run(main())


def serve_h2_grpc(sess, iname, oname, port: int) -> None:
    """gRPC's unary call on asyncio over h2 (HTTP/2 in pure Python), no grpcio: HEADERS and DATA in, the reply's
    HEADERS, DATA and trailers out. What a gRPC front costs without grpc.aio's machinery."""
    import h2.config
    import h2.connection
    import h2.events
    from modelcache.triton_protos import grpc_service_pb2 as pb

    def model_infer(request):
        return _grpc_infer(sess, iname, oname, request)

    config = h2.config.H2Configuration(client_side=False, header_encoding=None)
    reply_headers = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    trailers = [(b"grpc-status", b"0")]

    class H2(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            self.conn = h2.connection.H2Connection(config)
            self.conn.initiate_connection()
            self.bodies = {}
            transport.write(self.conn.data_to_send())

        def data_received(self, data):
            for event in self.conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    self.bodies[event.stream_id] = []
                elif isinstance(event, h2.events.DataReceived):
                    self.bodies[event.stream_id].append(event.data)
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    body = b"".join(self.bodies.pop(event.stream_id))
                    request = pb.ModelInferRequest.FromString(body[5:])
                    raw = model_infer(request).SerializeToString()
                    sid = event.stream_id
                    self.conn.send_headers(sid, reply_headers)
                    self.conn.send_data(sid, b"\0" + len(raw).to_bytes(4, "big") + raw)
                    self.conn.send_headers(sid, trailers, end_stream=True)
            self.transport.write(self.conn.data_to_send())

    _listen(H2, port)


def _serve(kind: str, path: str, port: int) -> None:
    global UVLOOP_ON
    sess, iname, oname = _session(path)
    UVLOOP_ON = kind.endswith("-uvloop")
    kind = kind.removesuffix("-uvloop")
    if kind == "raw-http":
        serve_raw_http(sess, iname, oname, port)
    elif kind == "httptools":
        serve_httptools(sess, iname, oname, port)
    elif kind == "aiohttp":
        serve_aiohttp(sess, iname, oname, port)
    elif kind == "h2-grpc":
        serve_h2_grpc(sess, iname, oname, port)
    else:
        serve_grpc(sess, iname, oname, port, aio=kind == "grpc-aio")


def report(res: dict, out=sys.stdout) -> None:
    print(f"tiny-cnn, one process, ORT inline (1 thread, no spin); tritonclient closed loop, batch 1, "
          f"{res['seconds']:g} s a run, {res['rounds']} rounds alternating the servers; median [min-max]", file=out)
    for clients, by_server in res["runs"].items():
        print(f"\n{clients} client(s):", file=out)
        print(f"  {'server':10s} {'requests/s':>22s} {'p50 us':>8s} {'server CPU a request, us':>26s} "
              f"{'clients CPU, us':>16s}", file=out)
        for server, runs in by_server.items():
            def spread(values, fmt="{:.0f}"):
                return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"
            print(f"  {server:10s} {spread([r['rps'] for r in runs]):>22s} "
                  f"{statistics.median(r['p50_us'] for r in runs):8.0f} "
                  f"{spread([r['server_cpu_us']['server'] for r in runs]):>26s} "
                  f"{statistics.median(r['client_cpu_us'] for r in runs):16.0f}", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", choices=SERVERS + UVLOOP + EXTRA, default=list(SERVERS))
    ap.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write report.txt and results.json here")
    ap.add_argument("--serve", nargs=3, metavar=("KIND", "MODEL", "PORT"), help=argparse.SUPPRESS)
    args, argv = ap.parse_args(argv), argv if argv is not None else sys.argv[1:]
    if args.serve:
        _serve(args.serve[0], args.serve[1], int(args.serve[2]))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run import _free_port, _stop, closed_loop
    from modelcache.bench.http import one_input_io
    from modelcache import zoo
    from modelcache.measure import save_results

    res = {"seconds": args.seconds, "rounds": args.rounds, "runs": {}}
    procs = {}
    with tempfile.TemporaryDirectory(prefix="mc-floor-") as tmp:
        path = str(Path(tmp) / "tiny-cnn.onnx")
        zoo.save(zoo.build("tiny-cnn"), path)
        io = one_input_io(path)
        try:
            for kind in args.servers:
                port = _free_port()
                proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, path, str(port)],
                                        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(
                                            Path(__file__).resolve().parents[2])})
                procs[kind] = (proc, f"127.0.0.1:{port}")
                if proc.stdout.readline().strip() != "READY":
                    raise RuntimeError(f"{kind} did not start")
            for r in range(args.rounds):
                order = args.servers[r % len(args.servers):] + args.servers[:r % len(args.servers)]
                for clients in args.clients:
                    for kind in order:
                        print(f"round {r + 1}: {clients} clients, {kind} ...", file=sys.stderr, flush=True)
                        proc, address = procs[kind]
                        run = closed_loop(f"floor-{'grpc' if 'grpc' in kind else 'http'}", address,
                                          "tiny-cnn", io, clients, args.seconds, {"server": proc.pid})
                        res["runs"].setdefault(str(clients), {}).setdefault(kind, []).append(run)
        finally:
            for proc, _ in procs.values():
                _stop(proc)
    report(res)
    save_results(args.out, "grpc-floor", argv, res, report, command="python benchmarks/grpc/floor.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
