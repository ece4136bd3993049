"""matplotlib for writing figures to files, optional: the benchmarks and `modelcache place --plots` draw with it."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with a note) when the [bench] extra is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: install modelcache[bench] (matplotlib)", file=sys.stderr)
        return None
    return plt
