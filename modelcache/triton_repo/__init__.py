"""A Triton model repository imported as it is: `modelcache import-triton REPO`, and the daemon's
`triton_repository` setting (the same command, run by the daemon at start).

config.py reads one model directory: its config.pbtxt (protobuf text format against Triton's
model_config.proto), completed from the ONNX model where absent as Triton's auto-complete does, checked
against the model, and mapped onto modelcache's batching; importer.py walks the repository and adds what
is new, through the daemon or straight into the repository.
"""
