"""How the daemon's messages say counts and sizes, so that every message says them alike."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str = "") -> str:
    """'1 session', '2 sessions': a count that reads right in a message."""
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


def size_text(n: int) -> str:
    """Bytes as a message shows them: MiB, or KiB below one."""
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"
