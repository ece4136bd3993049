"""What holds a model's copies: every hold has a holder, named by its kind, and a lease is one kind of hold.

A copy a holder maps or runs over is never freed (TierCopy.check_freeable). The holders: a client's
lease (a session), a serve request in flight, a profile run, and a serve-mode GPU worker that may have
sessions over a device copy. Each is a `Hold` (a `Lease` adds its id and client), taken and ended only by
its tier's residency manager (manager.py), which records in the hold the tiers it holds; the lease table
(`LeaseTable`, one for every tier of a daemon) is the manager's too.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

from ...errors import LeaseError


@dataclass(frozen=True)
class Kind:
    """A kind of holder, as a message names it ("1 session", "2 requests in flight"), and what frees the copy
    of it: the advice a capacity error ends with."""
    noun: str
    nouns: str
    advice: str
    gpu_prefix: str = ""      # said before the noun on a GPU copy ("GPU " session), where it reads differently

    def count(self, n: int, gpu: bool) -> str:
        return f"{n} {self.gpu_prefix if gpu else ''}{self.noun if n == 1 else self.nouns}"


# What to do about each reason a copy is kept in its tier: capacity errors end with these.
CLOSE_SESSIONS, UNPIN, WAIT = "close sessions", "unpin", "wait for the load to finish"

SESSION = Kind("session", "sessions", CLOSE_SESSIONS, gpu_prefix="GPU ")
REQUEST = Kind("request in flight", "requests in flight", "wait for the requests in flight")
PROFILE = Kind("profile run", "profile runs", "wait for the profile run")
WORKER = Kind("serve-mode GPU worker", "serve-mode GPU workers",
              "wait serve_idle_s for the serve-mode GPU workers to let go (they do once the model has no requests)")


@dataclass(eq=False)   # an identity: two holds of one kind are two holders
class Hold:
    """One holder's hold on a model's copy in one tier or more (and on the copies below each, which a copy
    above holds). `tiers`: the residency managers it was taken in, in order; ended in reverse."""
    kind: Kind
    model: object = field(repr=False)            # the ModelRecord
    tiers: list = field(default_factory=list, repr=False)


@dataclass(eq=False)
class Lease(Hold):
    """A client's lease: the hold an open grants, until its close, its client's goodbye, or its client's end."""
    lease_id: str = ""
    client_id: str = ""


class LeaseTable:
    """The daemon's leases by id, and by client: one table for every tier (a lease id names one lease anywhere)."""

    def __init__(self):
        self.by_id: dict[str, Lease] = {}
        self.by_client: dict[str, set] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self.by_id)

    def new(self, client_id: str, model) -> Lease:
        lease = Lease(SESSION, model, lease_id=f"l{next(self._ids)}-{secrets.token_hex(4)}", client_id=client_id)
        self.by_id[lease.lease_id] = lease
        self.by_client.setdefault(client_id, set()).add(lease.lease_id)
        return lease

    def take(self, lease_id: str, client_id: str | None = None) -> Lease:
        """Take a lease off the table (LeaseError when it is not there, or is another client's)."""
        lease = self.by_id.get(lease_id)
        if lease is None or (client_id is not None and lease.client_id != client_id):
            raise LeaseError(f"unknown lease {lease_id!r}")
        del self.by_id[lease_id]
        ids = self.by_client.get(lease.client_id)
        if ids is not None:
            ids.discard(lease_id)
            if not ids:
                del self.by_client[lease.client_id]
        return lease

    def discard(self, lease: Lease) -> None:
        """Off the table if it is there (a lease its client did not end)."""
        if self.by_id.get(lease.lease_id) is lease:
            self.take(lease.lease_id)

    def of_client(self, client_id: str) -> list[str]:
        return sorted(self.by_client.get(client_id, ()))
