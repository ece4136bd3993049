"""Triton's classification extension (protocol/extension_classification.md): a requested output with the
`classification` parameter (HTTP) or `class_count` (gRPC: the output's `classification` parameter) comes back as
its top N classes instead of its values: BYTES strings "value:index" or "value:index:label", highest first,
labels from the output's `label_filename` in the model's Triton configuration. A batching model (max_batch_size
> 0) classifies each row, shape [batch, N]; otherwise the whole tensor is one classification, shape [N].
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def class_count(value, output: str) -> int:
    """A request's classification parameter, checked: a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"output {output!r}: classification {value!r}: ask for a number of classes >= 1")
    return value


def classify(values: np.ndarray, count: int, labels: list | None, batch: bool, output: str) -> np.ndarray:
    """The top `count` classes of `values` as Triton writes them (its value as C++'s std::to_string does)."""
    if values.dtype.kind not in "fiub":
        raise InputError(f"output {output!r} holds {values.dtype} values: only numbers can be classified")
    rows = values.reshape(values.shape[0], -1) if batch and values.ndim else values.reshape(1, -1)
    count = min(count, rows.shape[1])
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
    text = (lambda v: f"{float(v):f}") if values.dtype.kind == "f" else (lambda v: str(int(v)))
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, row in enumerate(order):
        for c, i in enumerate(row):
            label = f":{labels[i]}" if labels and i < len(labels) else ""
            out[r, c] = f"{text(rows[r, i])}:{i}{label}".encode()
    return out if batch and values.ndim else out[0]
