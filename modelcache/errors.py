"""Typed errors a user can act on; each has a stable code so it crosses the wire intact."""

from __future__ import annotations


class ModelCacheError(Exception):
    """Base of every error modelcache raises on purpose."""

    code = "error"


class DaemonUnavailable(ModelCacheError):
    """No daemon answers at the configured socket (not started, crashed, or wrong MODELCACHE_SOCKET)."""

    code = "daemon_unavailable"


class ConfigError(ModelCacheError):
    """A setting (file, environment, flag or argument) that cannot be meant: the message names it and its range."""

    code = "config"


class RequestTimeout(ModelCacheError):
    """The daemon did not answer within the request timeout."""

    code = "timeout"


class ProtocolError(ModelCacheError):
    """A message did not decode into the type its kind names, or versions disagree."""

    code = "protocol"


class RecordError(ProtocolError):
    """A nested record of a request (a batching profile, a placement plan) is not what its type says: the
    caller's input, refused as the message is decoded, so the caller sees an InputError."""

    code = "input"


class ModelNotFound(ModelCacheError):
    """No model (or no such version of it) in the repository."""

    code = "not_found"


class PackError(ModelCacheError):
    """The .onnx file could not be validated, optimized or packed."""

    code = "pack"


class InputError(ModelCacheError, ValueError):
    """Feeds do not match the model's inputs (names, dtypes or shapes)."""

    code = "input"


class RunError(ModelCacheError):
    """Serve mode: a stage of the model failed while running, and not because of the request's data
    (that is an InputError): the model or the runtime is at fault, so the same request fails again."""

    code = "run"


class CapacityError(ModelCacheError):
    """A tier is full and nothing in it may be evicted."""

    code = "capacity"


class OutOfMemoryError(CapacityError):
    """A promotion would leave less memory free under the memory limit (RAM, or the cgroup's) than
    memory_reserve, even with every idle model given back: refused rather than risk the OOM killer."""

    code = "out_of_memory"


class RemoteError(ModelCacheError):
    """The remote store could not be read, or what it sent does not match its index."""

    code = "remote"


class StorageError(ModelCacheError):
    """A tier's file system is full or read-only; the message names the path and the model."""

    code = "storage"


class IntegrityError(ModelCacheError):
    """A stored file of a model version does not match the checksum written when it was added."""

    code = "corrupt"


class LeaseError(ModelCacheError):
    """An unknown or expired lease or client id."""

    code = "lease"


class PermissionDenied(ModelCacheError, PermissionError):
    """The caller may not do this: the socket is not theirs to reach, or the model or client id is another user's."""

    code = "permission"


class NotAllowed(ModelCacheError):
    """What the server's configuration does not serve now (a repository load where model_control is not explicit)."""

    code = "not_allowed"


ERRORS_BY_CODE = {cls.code: cls for cls in (ModelCacheError, DaemonUnavailable, RequestTimeout, ProtocolError,
                                            ModelNotFound, PackError, InputError, RunError, CapacityError,
                                            OutOfMemoryError, LeaseError, StorageError, RemoteError, IntegrityError,
                                            PermissionDenied, NotAllowed)}


def from_code(code: str, message: str) -> ModelCacheError:
    return ERRORS_BY_CODE.get(code, ModelCacheError)(message)
