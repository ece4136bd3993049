"""modelcache: a resident ONNX model cache; clients open models by name and map their weights.

`import modelcache` stays cheap: onnxruntime and numpy load only when a session is built.
"""

__version__ = "0.1.0"

__all__ = ["connect", "InferenceSession", "__version__", "errors"]


def __getattr__(name):
    if name == "connect":
        from .client.connection import connect
        return connect
    if name == "InferenceSession":
        from .client.session import InferenceSession
        return InferenceSession
    if name == "errors":
        from . import errors
        return errors
    if name in ("ModelCacheError", "DaemonUnavailable", "RequestTimeout", "ModelNotFound", "InputError",
                "PackError", "CapacityError", "OutOfMemoryError", "ProtocolError", "LeaseError"):
        from . import errors
        return getattr(errors, name)
    raise AttributeError(f"module 'modelcache' has no attribute {name!r}")
