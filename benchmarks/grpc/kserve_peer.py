"""The peer of benchmarks/grpc/run.py: a KServe Python model server running plain ONNX Runtime, one model each.

Run by path with the interpreter of a venv that has `kserve` and `onnxruntime` (modelcache is not needed
there, nor imported):

    /path/to/kserve-venv/bin/python -I kserve_peer.py --grpc-port 8081 --http-port 8080 NAME=MODEL.onnx ...

KServe's own server (FastAPI over uvicorn for REST, grpc.aio for its v2 gRPC service, the same
inference.GRPCInferenceService Triton's clients call): each request's inputs as numpy, one
InferenceSession.run, the outputs back raw (what tritonclient's as_numpy reads), as KServe's custom
predictor examples write it.
"""

import argparse

import onnxruntime as ort
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer


class OrtModel(Model):
    def __init__(self, name: str, path: str, spin: bool = True):
        super().__init__(name)
        self.path, self.spin = path, spin
        self.load()

    def load(self) -> bool:
        options = ort.SessionOptions()
        if not self.spin:   # (ORT's default: the intra-op pool's threads spin between runs, burning idle cores)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.ready = True
        return True

    def predict(self, payload: InferRequest, headers=None, response_headers=None) -> InferResponse:
        feeds = {i.name: i.as_numpy() for i in payload.inputs}
        results = self.session.run(None, feeds)
        outs = []
        for name, value in zip(self.outputs, results):
            out = InferOutput(name=name, shape=list(value.shape), datatype="FP32")
            out.set_data_from_numpy(value, binary_data=True)
            outs.append(out)
        return InferResponse(response_id=payload.id, model_name=self.name, infer_outputs=outs,
                             use_binary_outputs=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--grpc-port", type=int, required=True)
    ap.add_argument("--http-port", type=int, required=True)
    ap.add_argument("--no-spin", action="store_true", help="ORT's intra-op threads block rather than spin")
    ap.add_argument("models", nargs="+", help="NAME=PATH.onnx")
    args = ap.parse_args()
    models = [OrtModel(*spec.split("=", 1), spin=not args.no_spin) for spec in args.models]
    ModelServer(http_port=args.http_port, grpc_port=args.grpc_port, workers=1,
                enable_latency_logging=False).start(models)


if __name__ == "__main__":
    main()
