"""Triton's protocol and model configuration as protobuf: the .proto files vendored from
triton-inference-server/common (protobuf/, BSD-3-Clause, their license header kept) and the Python modules
grpcio-tools generated from them (generate.py; docs/grpc.md names the revision). Committed, so that running
needs only protobuf (model_config_pb2, which onnx's protobuf already satisfies) and grpcio (the services).
"""
