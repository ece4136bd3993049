"""A model's source files as file descriptors: opened by the adding client with its own rights,
passed to the daemon (SCM_RIGHTS over the lane), checked there, and copied by the packer.

Why descriptors: the daemon runs with rights its clients lack. Were it to open a path a
client names, a client could pack (and then run, or probe for) a file it cannot read itself.
A descriptor proves the client could open the file; the daemon never resolves a client's path.
"""

from __future__ import annotations

import os
import posixpath
import stat

from ..errors import PackError
from ..wire.lane import MAX_FDS

COPY_CHUNK = 8 << 20
# O_NONBLOCK: opening a FIFO for reading would wait for a writer; a regular file ignores the flag.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def external_data_locations(model) -> list[str]:
    """The external-data files an onnx.ModelProto's initializers (subgraphs' too) name, in first-seen order."""
    from onnx import TensorProto
    from .format import iter_graphs

    seen: dict[str, None] = {}
    for graph in iter_graphs(model.graph):
        for t in graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                location = {e.key: e.value for e in t.external_data}.get("location", "")
                seen.setdefault(location, None)
    return list(seen)


def check_source_names(names: list, what: str = "add") -> None:
    """The names a model's files travel under: the model's own file name first, then its external-data
    files relative to it. Each becomes a path inside the packer's private directory, so none may leave it."""
    if not names:
        raise PackError(f"{what}: no files; the client passes the model file's descriptor (upgrade the client)")
    for i, name in enumerate(names):
        if not isinstance(name, str) or not name or len(name) > 4096 or "\0" in name:
            raise PackError(f"{what}: file name {str(name)[:100]!r} is not a file name")
        normal = posixpath.normpath(name)
        if posixpath.isabs(name) or normal != name or normal.split("/")[0] == "..":
            raise PackError(f"{what}: {name!r} must be a plain path relative to the model's directory, "
                            "without '..'")
        if i == 0 and "/" in name:
            raise PackError(f"{what}: the model file's name {name!r} may not hold a directory")
    if len(set(names)) != len(names):
        raise PackError(f"{what}: a file is named twice in {names[:10]}")


def check_regular_files(fds: list[int], names: list[str], model: str) -> None:
    """Every descriptor is a regular file: a FIFO or a device would hang or flood the packer."""
    for fd, name in zip(fds, names):
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PackError(f"add {model}: {name} is not a regular file")


def open_model_files(path: str) -> tuple[list[str], list[int]]:
    """(names, descriptors) of the .onnx file at `path` and each external-data file it references, opened
    with this process's rights: an OSError here is the caller's own (it cannot read that file)."""
    path = os.path.abspath(path)
    fds = [os.open(path, _OPEN_FLAGS)]
    names = [os.path.basename(path)]
    try:
        check_regular_files(fds, [path], os.path.basename(path))
        with os.fdopen(os.dup(fds[0]), "rb") as f:   # parse what we opened, not the path again
            data = f.read()
        for location in _external_data_locations(data, path):
            location = posixpath.normpath(location)   # ("./w.bin" and "w.bin" are one file)
            check_source_names([names[0], location])
            fds.append(os.open(os.path.join(os.path.dirname(path), location), _OPEN_FLAGS))
            names.append(location)
        check_regular_files(fds, [os.path.join(os.path.dirname(path), n) for n in names], names[0])
        if len(fds) > MAX_FDS:
            raise PackError(f"{path} keeps its weights in {len(fds) - 1} files; one message passes at most "
                            f"{MAX_FDS}: save it with onnx's all_tensors_to_one_file=True")
        return names, fds
    except BaseException:
        close_all(fds)
        raise


def _external_data_locations(data: bytes, path: str) -> list[str]:
    """external_data_locations of the model file's bytes. Each external-data reference holds the key "location"
    (an onnx StringStringEntryProto): a file without those bytes names no other file, and is not parsed here (that
    took 0.16 s of ResNet-50's load, benchmarks/repoload/pack_profile.py); the packer parses it, and says what
    is wrong with it."""
    import onnx

    if b"location" not in data:
        return []
    try:
        model = onnx.load_model_from_string(data)   # (external data is not loaded from a string)
    except Exception as e:
        raise PackError(f"{path} is not a valid ONNX model: {str(e).strip()[:300]}") from None
    return external_data_locations(model)


def copy_sources(fds: list[int], names: list[str], dest: str) -> str:
    """Copy each descriptor's file (from its start, whatever its offset) to dest/name; returns the model's path."""
    for fd, name in zip(fds, names):
        target = os.path.join(dest, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "xb") as out:
            _copy_from(fd, out)
    return os.path.join(dest, names[0])


def _copy_from(fd: int, out) -> None:
    """All of fd's file into `out`, by explicit offsets (the client's descriptor shares its offset with the
    client). sendfile stays in the kernel: 100 MiB took 34-36 ms against 47-195 ms by pread and write."""
    offset = 0
    try:
        while sent := os.sendfile(out.fileno(), fd, offset, COPY_CHUNK):
            offset += sent
        return
    except OSError:   # a file system without sendfile: read and write from where it stopped
        pass
    while chunk := os.pread(fd, COPY_CHUNK, offset):
        out.write(chunk)
        offset += len(chunk)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
