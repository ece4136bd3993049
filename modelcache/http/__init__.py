"""The Open Inference Protocol (KServe v2 REST) in front of serve mode: `modelcache http`.

codec.py turns v2 request bodies (JSON tensors and the binary-tensor extension) into arrays and
outputs back into v2 responses; routes.py maps the v2 endpoints onto the operations both fronts
share (modelcache/oip: the daemon link, the operations, the error statuses); server.py runs it on
http1.py (HTTP/1.1 over llhttp, from httptools).
"""
