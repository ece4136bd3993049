"""Command-line usage errors as one line, for `modelcache` and every `modelcache bench NAME`.

argparse prints its usage block and then the error; a user who typed one wrong option
reads one line saying which, and where the help is, as every other failure reads.
"""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are `modelcache: COMMAND: what was wrong (where help is)`."""

    def error(self, message):
        first, _, rest = self.prog.partition(" ")
        where = rest if first == "modelcache" else self.prog   # `modelcache bench soak`: "bench soak"
        self.exit(2, f"modelcache: {where + ': ' if where else ''}{message} (`{self.prog} --help` for usage)\n")
