"""A gRPC stream's answer with a large output, serialized two ways in the front's process (grpc/codec.py).

  whole    the ModelInferResponse completed with its raw contents (protobuf copies each output in), wrapped in a
           ModelStreamInferResponse and serialized (copied again): what ModelStreamInfer did
  written  codec.write_stream_answer: the stream message's field 2 written around the answer's pieces, each output
           from a view of its array, joined once: what ModelInfer's answers already got (write_infer_answer)

Both are parsed back and compared first. Medians [min-max] of `--runs` each, alternated, in ms.

    python benchmarks/inputs/stream_answer.py [--mb 0.6 4.8 48] [--runs 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from modelcache.grpc import codec  # noqa: E402
from modelcache.triton_protos import grpc_service_pb2 as pb  # noqa: E402


def ways(mb: float):
    request = pb.ModelInferRequest(model_name="m", id="r1", inputs=[pb.ModelInferRequest.InferInputTensor(
        name="x", datatype="FP32", shape=[1])], raw_input_contents=[np.zeros(1, np.float32).tobytes()])
    req = codec.decode_request(codec.read_infer_request(request.SerializeToString()))
    outputs = {"y": np.random.default_rng(0).random(int(mb * 1e6) // 4, dtype=np.float32)}

    def whole():
        answer = codec.encode_response(req, 1, outputs)
        return pb.ModelStreamInferResponse(infer_response=answer.message()).SerializeToString()

    def written():
        return codec.write_stream_answer(codec.encode_response(req, 1, outputs))

    if pb.ModelStreamInferResponse.FromString(whole()) != pb.ModelStreamInferResponse.FromString(written()):
        raise SystemExit("the two ways wrote different messages")
    return {"whole": whole, "written": written}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, nargs="+", default=[0.6, 4.8, 48])
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    print(f"$ python benchmarks/inputs/stream_answer.py --mb {' '.join(f'{m:g}' for m in args.mb)} "
          f"--runs {args.runs}")
    print(f"(load average {os.getloadavg()[0]:.2f} at the start; ms, median [min-max] of {args.runs} runs, alternated)")
    for mb in args.mb:
        fns = ways(mb)
        times = {name: [] for name in fns}
        for _ in range(args.runs):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        row = "  ".join(f"{name} {statistics.median(t):.2f} [{min(t):.2f}-{max(t):.2f}]" for name, t in times.items())
        print(f"{mb:g} MB: {row}")


if __name__ == "__main__":
    main()
