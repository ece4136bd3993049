"""Which versions of a Triton model directory its version_policy serves: latest N (default 1), all, or specific
ones. The same for ONNX models (config.py) and ensembles (ensemble.py)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError
from ..triton_protos import model_config_pb2 as mc

VERSION_MAX = (1 << 63) - 1   # Triton's versions are int64


def present(model_dir: Path) -> list[int]:
    """The version directories there are (1/, 2/, ...), ascending; InputError for one past Triton's int64."""
    found = sorted(int(d.name) for d in model_dir.iterdir() if d.is_dir() and d.name.isdigit() and int(d.name) > 0)
    if found and found[-1] > VERSION_MAX:
        raise InputError(f"version directory {found[-1]}: past the largest version Triton numbers ({VERSION_MAX})")
    return found


def served(config: mc.ModelConfig, there: list[int]) -> list[int]:
    """The versions the policy names, of those `there`; a `specific` policy's as it names them, there or not."""
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        return there
    if policy == "specific":
        return sorted(set(config.version_policy.specific.versions))
    n = max(1, config.version_policy.latest.num_versions) if policy == "latest" else 1
    return there[-n:]
