"""A version replaced while it serves (P.Add with `replace`: a Triton repository load of a changed file): its
replacement is packed beside it while it keeps serving (reservations.staged_path), then swapped in within one turn
of the owner loop (files, then records), once nothing holds the old one.

Between the pack's end and the swap, the version's new opens and requests (and loads) wait here, and run again
once the swap is done, on the new version: what is in flight drains meanwhile, a front lets go of the sessions it
holds over the version within its next report (FrontServedReply.replacing). No request sees the version missing,
as every one did while it was removed and packed again (benchmarks/repoload/traffic.py). A session a client keeps
open is not taken from it: past `wait_s` the swap is given up, the old version stays, served, and the replace is
refused (CapacityError, as a removal in use is) with whatever waited run on the old one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CapacityError, ModelCacheError, ModelNotFound
from ..storage import remove_tree
from ..store.format import Manifest
from .registry import ModelRecord, Registry
from .wording import plural

log = logging.getLogger("modelcache.daemon")

POLL_S = 0.01   # how often a waiting swap tries again: the holds it waits for end within a turn of the loop


@dataclass(eq=False)
class _Swap:
    old: ModelRecord
    staged: Path
    manifest: Manifest
    then: object                       # then(error or None, the new record or None)
    deadline: float
    held_back: list = field(default_factory=list)   # (ident, request) to run again once it is done


class Swaps:
    def __init__(self, *, registry: Registry, host, repository, clock, redispatch, wait_s: float):
        self.registry = registry
        self.host = host                  # the host tier's Residency: it frees the old copies, refusing while held
        self.repository = repository      # tiers.disk.Repository: the files
        self.clock = clock
        self.redispatch = redispatch      # (ident, request): run a held-back request again
        self.wait_s = wait_s
        self.pending: dict[str, _Swap] = {}   # "name@version" -> its swap, waiting for the old one's holds to end

    def start(self, old: ModelRecord, staged: Path, manifest: Manifest, then) -> None:
        """Swap `staged` in for `old` now if nothing holds it, else as soon as nothing does (within wait_s);
        `then(error, new)` once it is done or given up."""
        swap = _Swap(old, staged, manifest, then, self.clock() + self.wait_s)
        if not self._try(swap):
            log.info("%s: its replacement is packed; swapping it in once what holds it lets go (%s)", old.key,
                     self._holders(old))
            self.pending[old.key] = swap

    def hold_back(self, ident, msg, model: ModelRecord) -> bool:
        """Whether a request of `model` waits for its swap (it runs again once the swap is done or given up)."""
        swap = self.pending.get(model.key)
        if swap is None or swap.old is not model:
            return False
        swap.held_back.append((ident, msg))
        return True

    def replacing(self) -> list[str]:
        return sorted(self.pending)

    def next_timer(self) -> float | None:
        return self.clock() + POLL_S if self.pending else None

    def on_timer(self, now: float) -> None:
        for key, swap in list(self.pending.items()):
            if self._try(swap):
                continue
            if now >= swap.deadline:
                remove_tree(swap.staged)
                self._done(swap, CapacityError(
                    f"{key} is in use ({self._holders(swap.old)}) and was not let go within {self.wait_s:g} s; it "
                    "cannot be replaced now, and stays as it was, served: close its sessions, or add the new file as "
                    "a new version"),
                    None)

    def _holders(self, model: ModelRecord) -> str:
        over_files = self.host.leases_over_files(model)
        return ", ".join(filter(None, [self.host.copy(model).holders_text(),
                                       over_files and f"{plural(over_files, 'session')} over its files"])) or "loading"

    def _try(self, swap: _Swap) -> bool:
        """Swap now if nothing holds the old one; whether it is done (swapped, or failed for good)."""
        old = swap.old
        if self.registry.models.get((old.name, old.version)) is not old:   # (an operator removed it meanwhile)
            remove_tree(swap.staged)
            self._done(swap, ModelNotFound(f"{old.key} was removed while its replacement was packed; add it again"),
                       None)
            return True
        try:
            self.host.remove(old, lambda: self.repository.replace(old.name, old.version, swap.staged), "replaced")
        except CapacityError:
            return False
        except ModelCacheError as e:   # (StorageError: the files could not be swapped; the old ones are in place)
            remove_tree(swap.staged)
            self._done(swap, e, None)
            return True
        self._done(swap, None, self.registry.add_model(self.repository.model_dir(old.name, old.version),
                                                       swap.manifest))
        return True

    def _done(self, swap: _Swap, error, new: ModelRecord | None) -> None:
        self.pending.pop(swap.old.key, None)
        swap.then(error, new)
        for ident, msg in swap.held_back:
            self.redispatch(ident, msg)
