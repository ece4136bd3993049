"""The Open Inference Protocol (KServe v2, Triton's extensions) as both fronts serve it, before any transport.

link.py is a front's asyncio end of the daemon's serve lane; types.py holds the protocol's datatypes and the
model descriptions (metadata, Triton's model configuration, statistics) as plain dicts; operations.py maps
each protocol operation onto daemon messages and every daemon error onto the protocol's status (HTTP and
gRPC). http/ puts them on llhttp (httptools), grpc/ on grpc.aio: each front only parses and writes its transport.
"""
