"""Triton's gRPC protocol (inference.GRPCInferenceService, grpc.health.v1) in front of serve mode: `modelcache grpc`.

codec.py turns ModelInferRequest tensors into arrays and outputs into raw_output_contents; service.py maps
each method onto the operations both fronts share (modelcache/oip); server.py runs it on grpc.aio. The
messages are Triton's own, generated from its .proto files (modelcache/triton_protos).
"""
