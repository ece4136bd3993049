"""The Open Inference Protocol (KServe v2 REST) in front of serve mode: `modelcache http`.

codec.py turns v2 requests (JSON tensors and the binary-tensor extension) into arrays and
outputs back into v2 responses; link.py is the front's asyncio end of the daemon's serve
lane; routes.py maps the v2 endpoints onto daemon messages; server.py runs it on aiohttp.
"""
