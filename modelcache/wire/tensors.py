"""Tensors on the wire for serve mode, and the feed check both sides share.

Small tensors travel inline in the message (msgpack bytes); large ones go through the socket only to a tcp://
daemon, which may be on another machine (`inline_up_to`):
- over the lane (drop-in sessions, connect()'s serve calls, the protocol fronts), in a memory file whose descriptor
  travels with the message (`passing`, client/input_buffers.py), sealed against shrinking, which the daemon maps
  (map_passed_inputs): nothing copied, no file to name or remove, and a client in another mount namespace sends
  them as well. The HTTP front passes a tensor where it lies in the request body it received into such a file
  ({"fd_at": [index, offset]}). Large outputs come back in a file the request lent (wire/lent_outputs.py);
- over ZeroMQ to an ipc:// daemon (which passes no descriptors), and a profile's, through a file in /dev/shm that the
  sender writes and the daemon reads. The daemon copies it out rather than mapping it: the client owns the file,
  and a mapped file that its owner truncates is a SIGBUS in whoever reads it next.
"""

from __future__ import annotations

import errno
import itertools
import math
import os

from ..errors import InputError, ProtocolError
from ..storage import remove_tree, storage_error

INLINE_MAX_BYTES = 256 * 1024
IO_DIR = "/dev/shm"        # where clients write the I/O files of large inputs, and the one place the daemon reads them
IO_PREFIX = "modelcache-io."
# numpy's dtype name -> ONNX Runtime's type string (NodeArg.type), and back.
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "float64": "tensor(double)",
             "int8": "tensor(int8)", "int16": "tensor(int16)", "int32": "tensor(int32)", "int64": "tensor(int64)",
             "uint8": "tensor(uint8)", "uint16": "tensor(uint16)", "uint32": "tensor(uint32)",
             "uint64": "tensor(uint64)", "bool": "tensor(bool)", "object": "tensor(string)"}
NUMPY_TYPES = {v: k for k, v in ORT_TYPES.items()}
_counter = itertools.count()
_dtype_names: dict = {}   # numpy dtype -> its name on the wire; asking numpy costs ~7 us a tensor
_dtypes: dict = {}        # and back: a name on the wire -> numpy dtype (only names numpy accepted)


def encode(arrays: dict, shm_dir: str = IO_DIR, group_of: str | None = None,
           inline_only: bool = False, model: str = "", passing=None, lent=None,
           inline_up_to: int | None = None) -> tuple[list, list[str]]:
    """name -> value  =>  (wire list, shm files the caller must unlink once answered).

    passing: a request's memory files (client/input_buffers.Passing), for a message that goes over the lane: large
    tensors are written there instead of into shm files; the caller sends `passing.fds` with it and settles them.

    A value is a tensor (numpy array or scalar), or what ORT takes and returns besides: a sequence
    (list), an optional's None, a map (dict, ZipMap's output). The daemon answers inline
    (`inline_only`): it cannot know when a client has read a file; `lent`, the files the request lent for its outputs
    (wire/lent_outputs.LentFiles), take those they have room for ({"lent_at": [index, offset]}). A file that cannot
    be written (a full /dev/shm) is a StorageError naming the input, `model` and the file; no file of the call stays.

    inline_up_to: a request to a tcp:// daemon, which may be on another machine (or see another /dev/shm): every
    tensor inline, and an InputError where they come to more than a message of that many bytes holds (the daemon's
    max_message_size ends a longer one's connection, and the client is told the daemon stopped or crashed).
    """
    if inline_up_to is not None:
        inline_only = True
    wire, files = [], []
    try:
        for name, value in arrays.items():
            try:
                entry = _encode_value(value, shm_dir, group_of, inline_only, files, passing, lent)
            except OSError as e:
                raise storage_error(e, f"passing input {name!r}" + (f" of {model}" if model else ""), shm_dir) \
                    or e from None
            entry["name"] = name
            wire.append(entry)
        if inline_up_to is not None:
            _check_message_size(wire, inline_up_to, model)
    except BaseException:
        for f in files:
            remove_tree(f)
        raise
    return wire, files


MESSAGE_MARGIN = 64 << 10   # a request's bytes besides its tensors' (names, shapes, the message's fields), at most


def _check_message_size(wire: list, limit: int, model: str) -> None:
    total = sum(len(e["data"]) for e in wire if "data" in e)
    if total > limit - MESSAGE_MARGIN:
        raise InputError(f"{model + ': ' if model else ''}the request's tensors come to {total} bytes, more than a "
                         f"message of max_message_size ({limit} bytes) holds: a tcp:// daemon takes them in the "
                         "message, since no file of this machine reaches it. Send fewer rows a request, or raise "
                         "max_message_size for the daemon and this client alike")


def _encode_value(value, shm_dir: str, group_of: str | None, inline_only: bool, files: list, passing=None,
                  lent=None) -> dict:
    if value is None or isinstance(value, (list, tuple, dict)):
        return _encode_composite(value)
    return _encode_tensor(value, shm_dir, group_of, inline_only, files, passing, lent)


def _encode_tensor(value, shm_dir: str, group_of: str | None, inline_only: bool, files: list, passing=None,
                   lent=None) -> dict:
    import numpy as np

    a = np.asarray(value)   # (not ascontiguousarray: it turns a 0-d scalar into shape [1])
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    if a.dtype.kind in "OUS":  # strings: a list of str on the wire, an object array again at the other end
        return {"dtype": "object", "shape": list(a.shape), "strings": [_as_str(v) for v in a.ravel().tolist()]}
    dtype = _dtype_names.get(a.dtype)
    if dtype is None:
        dtype = _dtype_names[a.dtype] = a.dtype.name
    entry = {"dtype": dtype, "shape": list(a.shape)}
    if a.nbytes <= INLINE_MAX_BYTES:
        entry["data"] = a.tobytes()
        return entry
    if inline_only:   # (a large output in the daemon's reply)
        data = memoryview(a).cast("B")
        placed = lent.place(data) if lent else None
        if placed is not None:   # written into a file the client lent for it
            entry["lent_at"] = list(placed)
        else:                    # msgpack packs it from the array, no copy before
            entry["data"] = data
        return entry
    if passing is not None:
        placed = passing.put(memoryview(a).cast("B"))
        if placed is None:   # (the request passes as many as it may already)
            entry["data"] = a.tobytes()
            return entry
        index, offset = placed
        # A slice is not {"fd", "offset"}: a daemon before slices would read the file's start. "fd_at" it refuses.
        entry.update(nbytes=a.nbytes, ino=passing.inode(index), **({"fd_at": [index, offset]} if offset else
                                                                    {"fd": index}))
        return entry
    path = os.path.join(shm_dir, f"{IO_PREFIX}{os.getuid()}.{os.getpid()}.{next(_counter)}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    files.append(path)          # (from now: a write that fails leaves it for encode to remove)
    try:
        if group_of:  # let the daemon's group read it (a member may give a file to its group)
            try:
                os.fchown(fd, -1, os.stat(group_of).st_gid)
            except OSError:
                pass
        with os.fdopen(os.dup(fd), "wb") as f:
            f.write(memoryview(a).cast("B"))
    finally:
        os.close(fd)
    entry.update(shm=path, nbytes=a.nbytes)
    return entry


def _encode_composite(value) -> dict:
    """An optional's None, a sequence or a map; their elements travel inline."""
    if value is None:
        return {"none": True}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, (int, str)):
                raise InputError(f"a map's keys must be int or str (ORT's map types), not {type(k).__name__}")
        return {"map": [[k, _encode_value(v, IO_DIR, None, True, [])] for k, v in value.items()]}
    return {"seq": [_encode_value(v, IO_DIR, None, True, []) for v in value]}


def _as_str(v) -> str:
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    if not isinstance(v, str):
        raise InputError(f"a string tensor holds a {type(v).__name__}, not str")
    return v


def _string_array(entry: dict, shape: tuple):
    """An object array of str from the wire's list, checked: a peer cannot smuggle other objects in."""
    import numpy as np

    strings = entry["strings"]
    if not isinstance(strings, list) or len(strings) != math.prod(shape):
        raise ValueError(f"{len(strings) if isinstance(strings, list) else 'no'} strings for shape {list(shape)}")
    if not all(isinstance(v, str) for v in strings):
        raise TypeError("a string tensor's elements must all be str")
    arr = np.empty(len(strings), dtype=object)
    arr[:] = strings
    return arr.reshape(shape)


MAX_NESTING = 8   # sequences of maps of sequences...: ORT's types nest two or three deep


def decode(wire: list, passed=(), lent=()) -> tuple[dict, list]:
    """wire list => (name -> read-only array (or list / dict / None, see encode), mappings to close
    when the arrays are no longer used: none any more, since I/O files are read, not mapped; kept for
    callers). passed: the mappings of the memory files that came with the message (map_passed_inputs), which
    its tensors name by index; an array over one keeps it mapped while it lives. lent: (mapping, None, bytes
    allocated) of the files a request lent for its outputs, which an answer's tensors name by index ("lent_at")."""
    arrays, maps = {}, []
    if not isinstance(wire, list):
        raise ProtocolError("tensors must be a list")
    for entry in wire:
        try:
            arrays[entry["name"]] = _decode_value(entry, entry["name"], 0, passed, lent)
        except (ProtocolError, InputError):
            raise
        except (KeyError, TypeError, ValueError, OverflowError, OSError) as e:   # (overflow: a dim past 2**63)
            raise ProtocolError(f"malformed tensor {entry.get('name') if isinstance(entry, dict) else entry!r}: "
                                f"{e}") from None
    return arrays, maps


def _decode_value(entry: dict, name: str, depth: int, passed=(), lent=()):
    import numpy as np

    if "shape" not in entry:   # not a tensor: an optional's None, a sequence or a map
        if depth >= MAX_NESTING:
            raise ValueError(f"values nested deeper than {MAX_NESTING}")
        if entry.get("none"):
            return None
        if "seq" in entry:
            items = entry["seq"]
            if not isinstance(items, list):
                raise TypeError("a sequence must be a list")
            return [_decode_value(e, name, depth + 1) for e in items]
        pairs = entry["map"]
        if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], (int, str))
                                                  for p in pairs):
            raise TypeError("a map must be a list of [int or str key, value] pairs")
        return {k: _decode_value(v, name, depth + 1) for k, v in pairs}
    shape = entry["shape"]
    if not isinstance(shape, list):
        raise TypeError(f"shape must be a list, got {type(shape).__name__}")
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in {list(shape)}")
    if "strings" in entry:
        return _string_array(entry, shape)
    dtype = _dtypes.get(entry["dtype"])   # (an unhashable one, a list or a map, is a TypeError)
    if dtype is None:
        dtype = np.dtype(entry["dtype"])
        if len(_dtypes) < 64:             # a peer cannot grow it without bound
            _dtypes[entry["dtype"]] = dtype
    if "data" in entry:
        buf = entry["data"]
    elif depth:
        raise ValueError("a sequence's or map's tensors travel inline")
    elif "fd" in entry or "fd_at" in entry:
        index, offset = (entry["fd"], 0) if "fd" in entry else entry["fd_at"]
        buf = passed_input(passed, index, entry.get("ino"), name, math.prod(shape) * dtype.itemsize, offset)
        if offset % dtype.alignment:   # (a tensor after one of an odd size in a body): ORT's kernels read it aligned
            buf = bytes(buf)
    elif "lent_at" in entry:   # an output the daemon wrote into a file this request lent it (wire/lent_outputs.py)
        index, offset = entry["lent_at"]
        buf = passed_input(lent, index, None, name, math.prod(shape) * dtype.itemsize, offset, "lent")
    else:
        buf = read_io_file(entry["shm"], name, math.prod(shape) * dtype.itemsize)
    # Not np.ndarray(shape, dtype, buf), though it is one call less: it reads an object dtype
    # out of raw bytes (pointers from the wire) and takes a -1 dim. frombuffer refuses both.
    return np.frombuffer(buf, dtype=dtype, count=math.prod(shape)).reshape(shape)


def remove_io_files_of(pid: int) -> int:
    """Remove the I/O files a dead client process left behind (a SIGKILL between writing one and
    unlinking it after the reply); returns how many. Only files named for that pid
    (IO_PREFIX + UID.PID.N, as encode names them) and owned by the uid in their name."""
    import stat

    removed = 0
    with os.scandir(IO_DIR) as entries:
        for entry in entries:
            parts = entry.name[len(IO_PREFIX):].split(".") if entry.name.startswith(IO_PREFIX) else ()
            if len(parts) != 3 or parts[1] != str(pid):
                continue
            try:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and str(st.st_uid) == parts[0]:
                    os.unlink(entry.path)
                    removed += 1
            except OSError:
                pass
    return removed


def read_io_file(path, name: str, nbytes: int):
    """The first `nbytes` of a client's I/O file, copied into the reader's memory (read-only array).

    Opened so that a client cannot make the reader wait or read for it what it may not read
    itself: only a regular file with one name, directly in IO_DIR and named IO_PREFIX*; a
    symbolic link is not followed (it let a client read files only the daemon could), and a FIFO
    or device is refused, never waited on (opening a FIFO blocked the daemon's owner loop until
    someone wrote to it). Copied, not mapped: a client that truncated its file after sending it
    took the daemon down with SIGBUS when the model read the mapping. The copy costs about what
    the mapping's page faults did up to a few MB (0.96 against 0.84 ms for 4.8 MB, read once
    after); a 48 MB input pays 37 against 12 ms."""
    import numpy as np
    import stat

    if (not isinstance(path, str) or os.path.dirname(path) != IO_DIR
            or not os.path.basename(path).startswith(IO_PREFIX)):
        raise InputError(f"tensor {name!r}: {path!r} is not a modelcache I/O file ({IO_DIR}/{IO_PREFIX}*)")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "is a symbolic link" if e.errno == errno.ELOOP else f"cannot be opened ({e.strerror})"
        raise InputError(f"tensor {name!r}: I/O file {path} {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"tensor {name!r}: I/O file {path} is not a regular file")
        if st.st_nlink != 1:   # another name elsewhere on this file system: not a file the client wrote for us
            raise InputError(f"tensor {name!r}: I/O file {path} has {st.st_nlink} names (hard links)")
        if st.st_size < nbytes:
            raise InputError(f"tensor {name!r}: I/O file {path} holds {st.st_size} bytes; the tensor needs {nbytes}")
        data = np.empty(nbytes, np.uint8)
        with memoryview(data) as view:
            done = 0
            while done < nbytes:
                n = os.readv(fd, [view[done:]])
                if n == 0:
                    raise InputError(f"tensor {name!r}: I/O file {path} was truncated while it was read")
                done += n
    finally:
        os.close(fd)
    data.flags.writeable = False
    return data


def map_passed_inputs(fds: list) -> list:
    """The memory files a request passed (their descriptors stay the caller's to close), each mapped read-only:
    (mapping, inode, bytes allocated) each.

    Mapped, not copied: only a file sealed against shrinking (F_SEAL_SHRINK: a memfd, as client/input_buffers.py
    makes them) is taken, so no one can truncate it under the mapping (the SIGBUS that read_io_file copies to
    avoid). Its owner may still write into it: that changes only the answer to its own request. InputError for
    anything else passed (a pipe, a socket, a plain file, an unsealed memfd)."""
    import fcntl
    import mmap
    import stat

    maps = []
    for i, fd in enumerate(fds):
        try:
            st = os.fstat(fd)
            sealed = stat.S_ISREG(st.st_mode) and fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        except OSError:   # (EINVAL: a file system without seals)
            sealed = False
        if not sealed:
            raise InputError(f"descriptor {i} passed with the request is not a memory file sealed against shrinking "
                             "(memfd_create with MFD_ALLOW_SEALING, then F_ADD_SEALS F_SEAL_SHRINK): the daemon maps "
                             "the inputs it is given, and a file that can shrink under a mapping cannot be mapped")
        try:
            mapped = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ) if st.st_size else b""
        except OSError as e:   # (its address space or the map count exhausted)
            raise InputError(f"descriptor {i} passed with the request cannot be mapped: {e.strerror}") from None
        maps.append((mapped, st.st_ino, st.st_blocks * 512))
    return maps


def passed_input(passed, index, inode, name: str, nbytes: int, offset: int = 0, how: str = "passed"):
    """Tensor `name`'s bytes: `nbytes` from `offset` in the message's memory file number `index`, which must be the
    file of inode `inode` where the message names one (a client passes its files' inodes: client/input_buffers.py).
    `how` the files came: "passed" with the message, or "lent" by the request for its answer."""
    if type(index) is not int or not 0 <= index < len(passed):
        raise InputError(f"tensor {name!r}: names {how} descriptor {index!r}, and the request {how} {len(passed)}")
    if type(offset) is not int or offset < 0:
        raise InputError(f"tensor {name!r}: offset {offset!r} in its memory file is not a byte count >= 0")
    buf, ino, allocated = passed[index]
    if inode is not None and inode != ino:
        # Descriptors passed before it, and declared by no message, were taken as its own: not this request's data.
        raise ProtocolError(f"tensor {name!r}: passed descriptor {index} is not the memory file the request names "
                            f"(inode {ino}, not {inode}): the connection passed descriptors no message declared")
    end = offset + nbytes
    if len(buf) < end:
        raise InputError(f"tensor {name!r}: its memory file holds {len(buf)} bytes; the tensor needs {end}"
                         + (f" ({nbytes} from byte {offset})" if offset else ""))
    if allocated < end:
        # Reading its holes would allocate their pages here, charged to the daemon: the client pays for its input.
        raise InputError(f"tensor {name!r}: its memory file has {allocated} bytes written, and the tensor needs "
                         f"{end}: write the tensor into it, not only its size")
    return memoryview(buf)[offset:end]


_PYTHON_VALUES = (list, tuple, bool, int, float, str, bytes)   # what a feed converts to an input's dtype


class FeedCheck:
    """A model's declared inputs ({name, dtype, shape}), compiled once; check(feeds) runs per request.

    `optional` are the initializers a caller may override by feeding them (graph inputs with a
    default, IR >= 4): fed, they are checked like inputs; not fed, the stored weight is used."""

    def __init__(self, model: str, inputs: list[dict], optional: list[dict] = ()):
        self.model = model
        self._inputs = inputs
        self._required = frozenset(i["name"] for i in inputs)
        # name -> (dtype, declared shape, ((axis, size) of every fixed dim))
        self._spec = {i["name"]: (_numpy_dtype(i["dtype"]), i["shape"],
                                  # (a negative dim, in manifests written before packing read it as free, is free)
                                  tuple((k, d) for k, d in enumerate(i["shape"]) if isinstance(d, int) and d >= 0))
                      for i in (*inputs, *optional)}

    def _expected(self) -> str:
        return ", ".join(f"{i['name']} ({i['dtype']}, {i['shape']})" for i in self._inputs)

    def check(self, feeds: dict) -> dict:
        """Feeds that match by name, dtype and rank/fixed dims; InputError says what does not."""
        import numpy as np

        if not isinstance(feeds, dict):
            raise InputError(f"input_feed must be a dict of name -> array, not {type(feeds).__name__}")
        spec = self._spec
        if feeds.keys() != self._required:
            for k in feeds:
                if k not in spec:
                    raise InputError(f"{self.model}: unknown input {k!r}; the model takes {self._expected()}")
            for k in self._required:
                if k not in feeds:
                    raise InputError(f"{self.model}: missing input {k!r}; the model takes {self._expected()}")
        out = {}
        for name, value in feeds.items():
            dtype, shape, fixed = spec[name]
            if dtype is None:  # a sequence, optional or map, or a dtype numpy lacks: ORT checks it
                out[name] = value
                continue
            if not isinstance(value, np.ndarray):
                value = self._as_array(name, value, dtype)
            if (value.dtype is not dtype and value.dtype != dtype   # (numpy's builtin dtypes are singletons)
                    and not (dtype.kind == "O" and value.dtype.kind in "US")):  # ORT takes str arrays for strings
                raise InputError(f"{self.model}: input {name!r} must be {dtype.name}, got {value.dtype}")
            dims = value.shape
            if len(dims) != len(shape) or any(dims[k] != d for k, d in fixed):
                raise InputError(f"{self.model}: input {name!r} must have shape {shape}, got {list(dims)}")
            out[name] = value
        return out

    def _as_array(self, name: str, value, dtype):
        """A feed that is not a numpy array, as ORT takes it: a list (or a Python scalar, which ORT
        refuses) becomes an array of the input's declared dtype, numbers converted as numpy converts
        them (ORT does the same for a list: [1, 2] feeds a float32 input); anything else with a dtype
        of its own (a numpy scalar, an array-like) keeps it, to be checked like an array's."""
        import numpy as np

        if not isinstance(value, _PYTHON_VALUES):
            return np.asarray(value)
        try:
            return np.asarray(value, dtype=str if dtype.kind == "O" else dtype)
        except (ValueError, TypeError, OverflowError) as e:
            raise InputError(f"{self.model}: input {name!r}: cannot make a {dtype.name} tensor of that "
                             f"{type(value).__name__} ({e}); pass a numpy array") from None


def request_rows(feeds: dict) -> int:
    """A request's rows: its first feed's first dimension (a sequence, a scalar or no feed: 1)."""
    first = next(iter(feeds.values()), None)
    return first.shape[0] if getattr(first, "ndim", 0) else 1


def check_request(key: str, name: str, rows: int, max_batch: int | None, output_names: list | None,
                  outputs: list) -> None:
    """What the engine and a front running the model itself (oip/front_runs.py) refuse alike, with the same
    words: more rows than its configuration's max_batch_size (as Triton's), an output the model lacks."""
    if max_batch and rows > max_batch:
        raise InputError(f"{key}: a request of {rows} rows; its max_batch_size is {max_batch}")
    if output_names:
        unknown = [n for n in output_names if n not in outputs]
        if unknown:
            raise InputError(f"{name}: unknown output {unknown[0]!r}; the model has {outputs}")


def _numpy_dtype(name: str):
    """numpy's dtype of a declared input, or None for what numpy cannot name (a sequence, bfloat16
    without ml_dtypes...): those the feed check leaves to ORT."""
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        return None


def random_feeds(inputs: list[dict], batch: int = 1, seed: int = 0) -> dict:
    """Random feeds for declared inputs ({name, dtype, shape}): a free first dim is `batch`, other free dims 8."""
    import numpy as np

    rng = np.random.default_rng(seed)
    feeds = {}
    for e in inputs:
        shape = [d if isinstance(d, int) and d > 0 else (batch if i == 0 else 8) for i, d in enumerate(e["shape"])]
        dtype = np.dtype(e["dtype"])
        if dtype == np.bool_:
            feeds[e["name"]] = np.asarray(rng.random(shape) > 0.3)
        elif np.issubdtype(dtype, np.integer):
            feeds[e["name"]] = rng.integers(0, 100, size=shape).astype(dtype)
        else:
            feeds[e["name"]] = rng.standard_normal(shape).astype(dtype)
    return feeds
