"""Which copies leave a tier for room, and what a tier says when none can: the residency manager's choices,
as its eviction policy makes them (the policy only chooses; the manager frees), and its refusal."""

from __future__ import annotations

from ...errors import CapacityError
from ..wording import size_text


def capacity_refusal(key: str, needs: int, where: str, capacity: int, used: int, kept: dict,
                     setting: str) -> CapacityError:
    """The capacity error of every tier, from the tier's own accounting (`used`: its bytes without this
    model's reservation): a model larger than the whole tier only needs the setting raised; otherwise
    it names what holds the tier and why (`kept`: key -> TierCopy.why_kept), and what would free it."""
    if needs > capacity:
        return CapacityError(f"{key} needs {size_text(needs)} in {where}, more than the whole tier ({setting} = "
                             f"{size_text(capacity)}): the model alone does not fit; raise {setting}")
    held = [(k, reasons) for k, reasons in sorted(kept.items()) if reasons]
    advice = list(dict.fromkeys(todo for _, reasons in held for _, todo in reasons))
    holders = ", ".join(f"{k} ({', '.join(why for why, _ in reasons)})" for k, reasons in held)
    return CapacityError(f"{key} needs {size_text(needs)} in {where} ({size_text(capacity)}, "
                         f"{size_text(used)} used), and "
                         + (f"the models there cannot be evicted now: {holders}" if held else
                            "evicting the unused models there would not free enough (they share memory with "
                            "models in use)")
                         + f"; {', '.join(advice + [f'or raise {setting}'])}")


def choose_victims(policy, candidates: dict, bytes_freed_by, bytes_over: int,
                   prewarm_of: str | None = None) -> list | None:
    """The keys to evict from one tier to free `bytes_over`, or None when all candidates together fall short.
    For a pre-warm of `prewarm_of`, only the victims the policy's prewarm_victims offers (demand comes first).

    Shared segments free only when all their users go, so when the policy's per-model choice
    falls short we walk its order and count what a growing prefix frees together."""
    sizes = {k: bytes_freed_by([k]) for k in candidates}
    if prewarm_of is not None:
        victims = policy.prewarm_victims(prewarm_of, bytes_over, sizes)
    else:
        victims = policy.choose_victims(bytes_over, sizes)
    if not victims and prewarm_of is None:
        prefix = []
        for key in policy.order(list(candidates)):
            prefix.append(key)
            if bytes_freed_by(prefix) >= bytes_over:
                victims = prefix
                break
    if not victims or bytes_freed_by(victims) < bytes_over:
        return None
    return victims
