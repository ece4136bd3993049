"""How a front's process stops: SIGTERM or SIGINT only sets a flag; the front's own shutdown runs after it."""

from __future__ import annotations

import asyncio
import signal

# In-flight requests get this long at a stop: the daemon's own drain allows 60 s, but a front under systemd
# must exit within the unit's stop time too.
SHUTDOWN_TIMEOUT_S = 8.0


async def until_stopped() -> None:
    """Return once SIGTERM or SIGINT came."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
