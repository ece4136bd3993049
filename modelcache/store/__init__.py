"""The store: a packed model on disk, and everything that writes or checks it.

format.py (a stored version's files and manifest, graph walks; no onnx import), integrity.py (the checksums
of its files), reservations.py (who writes which version: temporary directories, writer locks),
packing.py (ONNX -> stored model), prepack.py (shared pre-packed MatMul weights), sources.py (a model's
files as descriptors: opened by the adding client, copied by the packer), scrub.py (`modelcache verify`).
The store sits above the wire and the settings and below the tiers. Importing this folder loads nothing.
"""
