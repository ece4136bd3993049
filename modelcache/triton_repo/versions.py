"""Which versions of a Triton model directory its version_policy serves: latest N (default 1), all, or specific
ones. The same for ONNX models (config.py) and ensembles (ensemble.py)."""

from __future__ import annotations

from pathlib import Path

from ..triton_protos import model_config_pb2 as mc


def present(model_dir: Path) -> list[int]:
    """The version directories there are (1/, 2/, ...), ascending."""
    return sorted(int(d.name) for d in model_dir.iterdir() if d.is_dir() and d.name.isdigit() and int(d.name) > 0)


def served(config: mc.ModelConfig, there: list[int]) -> list[int]:
    """The versions the policy names, of those `there`; a `specific` policy's as it names them, there or not."""
    policy = config.version_policy.WhichOneof("policy_choice")
    if policy == "all":
        return there
    if policy == "specific":
        return sorted(set(config.version_policy.specific.versions))
    n = max(1, config.version_policy.latest.num_versions) if policy == "latest" else 1
    return there[-n:]
