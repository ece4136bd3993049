"""Regenerate the committed *_pb2.py modules from the vendored .proto files beside this script.

    python -m venv /tmp/gen && /tmp/gen/bin/pip install 'protobuf==6.31.1' grpcio-tools
    /tmp/gen/bin/python modelcache/triton_protos/generate.py

The generator is pinned by the protobuf it runs with: generated code refuses a protobuf runtime older than
the one that generated it, and onnx allows protobuf >= 6.31.1, so 6.31.1 generates. No *_pb2_grpc modules:
the server builds its method handlers from the service descriptors (modelcache/grpc/handlers.py). Two
rewrites after protoc:
relative imports (protoc writes `import model_config_pb2`), and our own descriptor pool (_pool.py says why).
docs/grpc.md says which revision of triton-inference-server/common the .proto files come from.
"""

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("grpc_service.proto", "model_config.proto", "health.proto")


def main() -> int:
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"--python_out={HERE}",
                    *(str(HERE / p) for p in PROTOS)], check=True)
    for path in HERE.glob("*_pb2.py"):
        text = path.read_text()
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        text = text.replace("from google.protobuf import descriptor_pool as _descriptor_pool\n",
                            "from ._pool import POOL as _POOL\n")
        text = text.replace("_descriptor_pool.Default().AddSerializedFile(", "_POOL.AddSerializedFile(")
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
