"""The response cache: a served request whose inputs a model has answered before gets that answer again, without
running it (Triton's `response_cache { enable: true }`; docs/serve.md, "A response cache").

Only models that ask for it are cached (their manifest's `serving.response_cache`): a model is cached only where
the same inputs always give the same outputs, which the daemon cannot know. The daemon keeps one, on its owner
loop as the engine (no lock), that every client and front shares; each protocol front keeps one too, on its
loop (oip/operations.py), so that a hit there costs no round trip to the daemon.

The key is a SHA-256 of everything an answer depends on: the model version's identity (its key and the sha256
of the file it was added from, so a version removed and added again from another file never meets the old
answers), the outputs asked for, and each input's name, type, shape and bytes. SHA-256 rather than a fast
non-cryptographic hash (Triton's is boost's hash_combine into 64 bits, over the names and bytes only): one
client must not be able to craft inputs whose answer another client's different inputs would then get. It
hashes at ~1.4 GB/s here (SHA-NI): 0.4 ms for ResNet-50's 602 KB input, against a 65 ms run.

Bounded in bytes (the `response_cache_size` setting), least recently used out first. An answer bigger than
the whole cache is not kept. Memory pressure clears it first (daemon/memory.py): it is the cheapest memory the
daemon holds, as every answer can be computed again; the fronts hear of it in their reports' replies and clear
theirs (oip/front_runs.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

import numpy as np

ENTRY_OVERHEAD = 512   # bytes an entry costs beyond its arrays' data: the key, the dict, the arrays' headers


def model_identity(model_key: str, source_sha256: str) -> str:
    """What tells one model version's answers from another's: its key ("name@version") and its file's sha256."""
    return f"{model_key}\0{source_sha256}"


def request_key(identity: str, feeds: dict, output_names: list | None) -> bytes:
    """The cache key of a request: its model version's identity, the outputs it asks for (None: all of them,
    which is another answer than any subset) and every input, in name order."""
    h = hashlib.sha256()
    h.update(identity.encode("utf-8", "surrogateescape"))
    h.update(b"\0*" if output_names is None else b"\0" + "\0".join(sorted(output_names)).encode())
    for name in sorted(feeds):
        value = np.asarray(feeds[name])
        header = f"\0{name}\0{value.dtype.str}\0{value.shape}".encode("utf-8", "surrogateescape")
        h.update(struct.pack("<I", len(header)))
        h.update(header)
        if value.dtype == object:   # strings (BYTES): each element with its length, so no two lists hash alike
            for element in value.reshape(-1):
                raw = element if isinstance(element, bytes) else str(element).encode("utf-8", "surrogateescape")
                h.update(struct.pack("<Q", len(raw)))
                h.update(raw)
        else:
            h.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8))
    return h.digest()


def answer_bytes(outputs: dict) -> int:
    """What keeping an answer costs: its arrays' data, strings by their length, and the entry's overhead."""
    total = ENTRY_OVERHEAD
    for value in outputs.values():
        value = np.asarray(value)
        total += sum(len(str(e)) + 8 for e in value.reshape(-1)) if value.dtype == object else value.nbytes
    return total


def frozen(outputs: dict) -> dict:
    """An answer as the cache keeps it: each array its own read-only copy. A request's outputs may be rows of a
    batch's array (a view would keep the whole batch alive, uncounted), and no later request may change it."""
    kept = {}
    for name, value in outputs.items():
        value = np.array(value, copy=True, order="C")
        value.setflags(write=False)
        kept[name] = value
    return kept


class ResponseCache:
    """Answers by request key, least recently used first out, within `capacity_bytes` (0: off)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = max(0, int(capacity_bytes))
        self.entries: OrderedDict[bytes, tuple[str, dict, int]] = OrderedDict()   # key -> (owner, answer, bytes)
        self.owners: dict[str, set] = {}   # owner -> its keys (forget is asked of models that have none, often)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.inserted = 0
        self.evicted = 0
        self.too_big = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def get(self, key: bytes) -> dict | None:
        """The answer kept for `key` (its arrays read-only; a new dict each time), or None."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return dict(entry[1])

    def put(self, key: bytes, owner: str, outputs: dict) -> bool:
        """Keep `outputs` as the answer to `key` (`owner`: the model's name, for forget). False when it was not
        kept: the cache is off, or the answer alone is bigger than it."""
        if not self.enabled:
            return False
        size = answer_bytes(outputs)
        if size > self.capacity:
            self.too_big += 1
            return False
        if key in self.entries:
            self._drop(key)
        self.entries[key] = (owner, frozen(outputs), size)
        self.owners.setdefault(owner, set()).add(key)
        self.bytes += size
        self.inserted += 1
        self._fit(self.capacity)
        return True

    def forget(self, owner: str) -> int:
        """Drop every answer `owner` (a model's name) put; the bytes freed."""
        return sum(self._drop(key) for key in list(self.owners.get(owner, ())))

    def resize(self, capacity_bytes: int) -> None:
        """A new capacity (the setting reloaded): answers beyond it go, oldest first."""
        self.capacity = max(0, int(capacity_bytes))
        self._fit(self.capacity)

    def clear(self) -> int:
        """Drop every answer (memory pressure); the bytes freed."""
        freed = self.bytes
        self.evicted += len(self.entries)
        self.entries.clear()
        self.owners.clear()
        self.bytes = 0
        return freed

    def describe(self) -> dict:
        """For stats, status and metrics."""
        return {"capacity_bytes": self.capacity, "bytes": self.bytes, "entries": len(self.entries),
                "hits": self.hits, "misses": self.misses, "inserted": self.inserted, "evicted": self.evicted,
                "too_big": self.too_big}

    def _fit(self, capacity: int) -> None:
        while self.bytes > capacity and self.entries:
            self.evicted += 1
            self._drop(next(iter(self.entries)))

    def _drop(self, key: bytes) -> int:
        owner, _answer, size = self.entries.pop(key)
        keys = self.owners[owner]
        keys.discard(key)
        if not keys:
            del self.owners[owner]
        self.bytes -= size
        return size
