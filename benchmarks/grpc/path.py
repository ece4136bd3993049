"""Where a tiny-model request through tritonclient.grpc spends its time: the floor of each hop, side by side.

    python benchmarks/grpc/path.py [--calls 2000] [--out benchmarks/grpc]

One daemon of its own (tiny-cnn added), `modelcache grpc` and `modelcache http` in front of it, and sequential
calls from this process (batch 1), each path warmed first; medians and p99 in microseconds:

  ort in-process           onnxruntime.InferenceSession.run here: the compute
  lane                     ServeSession.run: this process -> the daemon's serve lane -> engine -> back
  grpc echo, sync server   grpc's floor: an empty unary call to a bare grpc.server in another process
  grpc echo, aio server    the same against grpc.aio.server (what `modelcache grpc` runs)
  grpc ServerLive          grpc's channel -> `modelcache grpc` (no daemon on the way)
  tritonclient ServerLive  tritonclient.grpc's is_server_live: the same call through Triton's client
  grpc ModelInfer          grpc's channel -> `modelcache grpc` -> lane -> daemon -> back
  tritonclient infer       tritonclient.grpc's infer + as_numpy: what `benchmarks/grpc/run.py` times
  tritonclient http infer  tritonclient.http (binary tensors) -> `modelcache http` -> lane -> back

The question it answers (issue 39's goal of a tiny-model p50 <= 1.0 ms through tritonclient.grpc): is that
within reach of a front in its own process? The sum of the grpc floor and the lane says.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def tiny_cnn_served(kinds: tuple, prefix: str):
    """A daemon of its own (a temporary directory, tiny-cnn added) with `modelcache KIND` in front of it for each
    kind: yields (socket, the model's .onnx, [(front process, host:port)]); ab.py's drivers use it too."""
    from modelcache.bench.http import start_front
    from modelcache.measure import ensure_models, managed_daemon

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        sock = f"ipc://{tmp}/daemon.sock"
        env = {**os.environ, "MODELCACHE_SOCKET": sock, "MODELCACHE_REPOSITORY": f"{tmp}/repo",
               "MODELCACHE_CONFIG": ""}
        with open(Path(tmp) / "fronts.log", "ab") as log, \
                managed_daemon(sock, f"{tmp}/repo", env={"MODELCACHE_CONFIG": ""}):
            path = ensure_models(sock, ["tiny-cnn"], Path(tmp) / "zoo")["tiny-cnn"]
            fronts = [start_front(env, log, kind) for kind in kinds]
            try:
                yield sock, path, fronts
            finally:
                for proc, _ in fronts:
                    proc.terminate()
                    proc.wait()


def sample_input(i):
    """A batch-1 float32 input for the ONNX input `i` (its symbolic dimensions as 1)."""
    import numpy as np
    return np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape]) \
        .astype(np.float32)


def model_infer(channel, name: str, x):
    """A bare grpc channel's ModelInfer of tiny-cnn with `x` as input `name`, as a call of no arguments."""
    from modelcache.triton_protos import grpc_service_pb2 as pb
    infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                request_serializer=pb.ModelInferRequest.SerializeToString,
                                response_deserializer=pb.ModelInferResponse.FromString)
    req = pb.ModelInferRequest(model_name="tiny-cnn", raw_input_contents=[x.tobytes()], inputs=[
        pb.ModelInferRequest.InferInputTensor(name=name, datatype="FP32", shape=list(x.shape))])
    return lambda: infer(req)


def _timed(call, n: int) -> tuple[float, float]:
    for _ in range(max(50, n // 10)):
        call()
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        lat.append((time.perf_counter() - t) * 1e6)
    lat.sort()
    return lat[n // 2], lat[int(n * 0.99)]


def _echo_table(fn):
    import grpc
    return grpc.method_handlers_generic_handler("t.S", {"Echo": grpc.unary_unary_rpc_method_handler(
        fn, request_deserializer=bytes, response_serializer=bytes)})


def _echo_server(kind: str, port_q) -> None:
    import asyncio
    import grpc
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        server.add_generic_rpc_handlers((_echo_table(lambda req, ctx: req),))
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    async def serve():
        async def echo(req, ctx):
            return req
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_echo_table(echo),))
        port_q.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()
    asyncio.run(serve())


def _echo(kind: str, n: int) -> tuple[float, float]:
    import grpc
    q = mp.Queue()
    proc = mp.Process(target=_echo_server, args=(kind, q), daemon=True)
    proc.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{q.get(timeout=60)}") as ch:
            call = ch.unary_unary("/t.S/Echo", request_serializer=bytes, response_deserializer=bytes)
            return _timed(lambda: call(b"x" * 100), n)
    finally:
        proc.terminate()
        proc.join()


def measure(n: int) -> dict:
    import onnxruntime as ort
    import grpc
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from modelcache.client.serve import ServeSession
    from modelcache.triton_protos import grpc_service_pb2 as pb

    res = {"grpc echo, sync server": _echo("sync", n), "grpc echo, aio server": _echo("aio", n)}
    with tiny_cnn_served(("grpc", "http"), "modelcache-grpc-path-") as (sock, path, fronts):
        (_, gaddr), (_, haddr) = fronts
        s = ort.InferenceSession(path)
        i, o = s.get_inputs()[0], s.get_outputs()[0].name
        x = sample_input(i)
        res["ort in-process"] = _timed(lambda: s.run(None, {i.name: x}), n)
        lane = ServeSession("tiny-cnn", socket=sock)
        res["lane"] = _timed(lambda: lane.run(None, {i.name: x}), n)
        with grpc.insecure_channel(gaddr) as ch:
            live = ch.unary_unary("/inference.GRPCInferenceService/ServerLive",
                                  request_serializer=pb.ServerLiveRequest.SerializeToString,
                                  response_deserializer=pb.ServerLiveResponse.FromString)
            res["grpc ServerLive"] = _timed(lambda: live(pb.ServerLiveRequest()), n)
            res["grpc ModelInfer"] = _timed(model_infer(ch, i.name, x), n)
        c = tg.InferenceServerClient(gaddr)
        res["tritonclient ServerLive"] = _timed(c.is_server_live, n)
        ti = tg.InferInput(i.name, list(x.shape), "FP32")
        ti.set_data_from_numpy(x)
        touts = [tg.InferRequestedOutput(o)]
        res["tritonclient infer"] = _timed(lambda: c.infer("tiny-cnn", [ti], outputs=touts).as_numpy(o), n)
        c.close()
        h = th.InferenceServerClient(haddr)
        hi = th.InferInput(i.name, list(x.shape), "FP32")
        hi.set_data_from_numpy(x)
        houts = [th.InferRequestedOutput(o)]
        res["tritonclient http infer"] = _timed(lambda: h.infer("tiny-cnn", [hi], outputs=houts).as_numpy(o), n)
        h.close()
    return res


def report(res: dict, out=sys.stdout) -> None:
    print("sequential calls, batch 1, tiny-cnn; microseconds: p50 / p99", file=out)
    order = ["ort in-process", "lane", "grpc echo, sync server", "grpc echo, aio server", "grpc ServerLive",
             "tritonclient ServerLive", "grpc ModelInfer", "tritonclient infer", "tritonclient http infer"]
    for k in order:
        p50, p99 = res[k]
        print(f"  {k:<26} {p50:8.0f} / {p99:8.0f}", file=out)
    floor = res["grpc echo, aio server"][0] + res["lane"][0]
    print(f"a front in its own process cannot beat grpc's floor plus the lane: {floor:.0f} us at the median "
          f"(the goal: tritonclient infer <= 1000 us)", file=out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = measure(args.calls)
    report(res)
    from modelcache.measure import save_results
    save_results(args.out, "grpc-path", argv, res, report, command="python benchmarks/grpc/path.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
