"""One ensemble directory of a Triton repository -> what to add: its versions and configuration, its steps
checked against the models they name (the ONNX models planned beside it, or models modelcache already has).
An ensemble with a step modelcache cannot serve (another backend's model, a model refused or absent, a stateful
model) is skipped with one line naming the step."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..executor.ensemble import Ensemble
from ..triton_protos import model_config_pb2 as mc
from .versions import present, served

ENSEMBLE_PLATFORM = "ensemble"


class StepNotServed(Exception):
    """The ensemble is skipped: one of its steps is not a model served here (the line says which, and why)."""


@dataclass
class EnsemblePlan:
    name: str
    versions: list        # [version]: its version directories (Triton's policy), 1 when it has none
    config: dict          # as Triton's JSON: what ModelConfig answers
    ensemble: Ensemble    # (of the latest version: every version has the same configuration)

    def steps_text(self) -> str:
        return " -> ".join(s.model for s in self.ensemble.order())


def is_ensemble(config: mc.ModelConfig | None) -> bool:
    return config is not None and config.platform == ENSEMBLE_PLATFORM


def plan_ensemble(model_dir: Path, config: mc.ModelConfig, config_json: dict) -> EnsemblePlan:
    """The plan of an ensemble directory; InputError when its configuration cannot be served as written."""
    name = model_dir.name
    if config.name and config.name != name:
        raise InputError(f"config.pbtxt names the model {config.name!r}, but its directory is {name!r}")
    config_json = {**config_json, "name": name}
    if not config.input or not config.output:
        raise InputError("an ensemble's config.pbtxt must list its inputs and outputs")
    chosen = served(config, present(model_dir)) or [1]   # (an ensemble without version directories: version 1)
    try:
        ensemble = Ensemble.of(name, chosen[-1], config_json)
    except InputError as e:
        raise InputError(str(e).removeprefix(f"{name}: ")) from None
    return EnsemblePlan(name, chosen, config_json, ensemble)


def check_steps(plan: EnsemblePlan, planned: dict, skipped: dict, refused: set, known) -> None:
    """Every step against the model it names: `planned` (name -> ModelPlan imported here), `skipped` (name ->
    why it is not ONNX), `refused` (names not imported), `known(name)` (the daemon's model's (inputs, outputs)
    names, or None). StepNotServed for a step modelcache cannot serve; InputError for wiring that does not fit."""
    batch = int(plan.config.get("max_batch_size", 0))
    for s in plan.ensemble.steps:
        if s.model in skipped:
            raise StepNotServed(f"{plan.name}: skipped: its {s.label} is {skipped[s.model]}; modelcache serves "
                                "ensembles whose steps are all ONNX models")
        if s.model in refused:
            raise StepNotServed(f"{plan.name}: skipped: its {s.label} was not imported")
        step = planned.get(s.model)
        if step is not None:
            if step.serving.get("sequence"):
                raise StepNotServed(f"{plan.name}: skipped: its {s.label} is a stateful model (sequence "
                                    "batching); ensembles of stateful models are not served")
            if s.version is not None and s.version not in [v for v, _ in step.versions]:
                raise StepNotServed(f"{plan.name}: skipped: its {s.label} names a version {s.model} does not have")
            ins = {t["name"] for t in step.config.get("input") or []}
            outs = {t["name"] for t in step.config.get("output") or []}
            step_batch = int(step.config.get("max_batch_size", 0))
            if batch > 0 and step_batch < batch:
                raise InputError(f"its max_batch_size {batch} is more than {s.label}'s ({step_batch})")
        else:
            have = known(s.model)
            if have is None:
                raise StepNotServed(f"{plan.name}: skipped: its {s.label} is neither in this repository nor in "
                                    "modelcache")
            ins, outs = have
        why = s.unmapped(ins, outs, s.model)
        if why:
            raise InputError(why)
