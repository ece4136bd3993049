"""Performance models: measured stage times per (model, stage, worker kind, batch), calibrated online.

Prediction is the median of the recent history (robust to the odd preempted run on a
shared machine). Each prediction made before a run is compared with the time that
run took, so the error figure is honest: it is measured on predictions actually used.
Persisted as JSON in the daemon's state directory and loaded at start.
"""

from __future__ import annotations

import json
import statistics
from collections import deque
from pathlib import Path

from ..storage import write_atomic

HISTORY = 32      # recent runs kept per key
MIN_SAMPLES = 2   # before this many runs, a key counts as uncalibrated


# Keys are (model, stage, kind, batch) tuples in memory (formatting a string cost more than the
# lookup, twice a request) and "model|stage|kind|batch" in the JSON file.
def _to_text(key: tuple) -> str:
    return "|".join(map(str, key))


def _from_text(text: str) -> tuple:
    model, stage, kind, batch = text.rsplit("|", 3)
    return model, int(stage), kind, int(batch)


class PerfModels:
    def __init__(self):
        self.recorded = 0                          # runs recorded, ever: a saver sees whether any came since
        self.history: dict[tuple, deque] = {}
        self.errors: deque = deque(maxlen=1000)   # |predicted - measured| / measured
        self._medians: dict[tuple, float] = {}      # predictions until the next record: several per request

    def predict(self, model: str, stage: int, kind: str, batch: int = 1) -> float | None:
        key = (model, stage, kind, batch)
        median = self._medians.get(key)
        if median is None:
            h = self.history.get(key)
            if h is None or len(h) < MIN_SAMPLES:
                return None
            median = self._medians[key] = statistics.median(h)
        return median

    def shortest(self, model: str, stage: int, kind: str) -> float | None:
        """The shortest predicted run of the stage at any batch size measured: a model whose clients always
        send a few rows is timed at those, never at 1. None until one is calibrated."""
        times = [self.predict(*key) for key in self.history if key[:3] == (model, stage, kind)]
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def record(self, model: str, stage: int, kind: str, batch: int, seconds: float,
               predicted: float | None = None) -> None:
        if predicted is not None and seconds > 0:
            self.errors.append(abs(predicted - seconds) / seconds)
        key = (model, stage, kind, batch)
        h = self.history.get(key)
        if h is None:
            h = self.history[key] = deque(maxlen=HISTORY)
        h.append(seconds)
        self._medians.pop(key, None)
        self.recorded += 1

    def median_error(self) -> float | None:
        return statistics.median(self.errors) if self.errors else None

    def summary(self) -> dict:
        return {"keys": len(self.history), "predictions_checked": len(self.errors),
                "median_error": self.median_error()}

    # -- persistence -------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({_to_text(k): list(v) for k, v in self.history.items()})

    def save(self, path: Path) -> None:
        """Write them to `path` whole (the daemon saves through a storage.StateFile instead)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> "PerfModels":
        pm = cls()
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return pm  # none yet, or unreadable: start uncalibrated
        try:
            for k, v in data.items():
                pm.history[_from_text(k)] = deque((float(x) for x in v), maxlen=HISTORY)
        except (AttributeError, TypeError, ValueError):
            return cls()  # not ours, or damaged: start uncalibrated rather than half-loaded
        return pm
