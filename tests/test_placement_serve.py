"""Serving with a placement plan: `partition --plan` on a real daemon with CPU groups "1,1"."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from modelcache import zoo
from modelcache.errors import InputError, PackError
from modelcache.placement.machine import cost_table, describe_machine
from modelcache.placement.plan import Plan, Stage
from test_serve import serving  # noqa: F401  (a daemon with CPU worker groups "1,1")


def hand_plan(serving, name: str, system, cut: int, sets: list) -> dict:
    """A two-stage plan over the packed model, cut before node `cut`, stage k on workers sets[k]."""
    table = cost_table(serving.repository / name / "1", name, system, batch=1)
    stages = [Stage(0, cut, tuple(sets[0]), (1,) + (0,) * (len(sets[0]) - 1)),
              Stage(cut, table.n, tuple(sets[1]), (1,) + (0,) * (len(sets[1]) - 1))]
    return Plan(stages, 1, model=f"{name}@1", system=system.name).to_json(system, table)


def test_a_plan_places_each_stage_on_its_workers_and_keeps_outputs(serving, zoo_file):
    system = describe_machine("1,1")
    feeds = zoo.sample_inputs(zoo_file("tiny-cnn"), batch=1)
    want = ort.InferenceSession(zoo_file("tiny-cnn"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    with serving.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        plan = hand_plan(serving, "cnn", system, 2, [[1], [0]])     # stage 0 on cpu-1, stage 1 on cpu-0
        stages = c.partition("cnn", plan=plan)
        assert [s["workers"] for s in stages] == [["cpu-1"], ["cpu-0"]]
        assert (serving.repository / "cnn" / "1" / "placement-plan.json").exists()
        for _ in range(4):
            outputs, timings = c.infer("cnn", feeds)
            np.testing.assert_allclose(next(iter(outputs.values())), want, rtol=1e-4, atol=1e-5)
            assert [s["worker"] for s in timings["stages"]] == [1, 0]
        # Undo: no stages, no plan kept.
        assert c.partition("cnn", stages=1) == []
        assert not (serving.repository / "cnn" / "1" / "placement-plan.json").exists()


def test_plans_for_another_model_or_other_workers_are_refused(serving, zoo_file):
    system = describe_machine("1,1")
    with serving.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
        c.add(zoo_file("tiny-vit"), "vit")
        plan = hand_plan(serving, "cnn", system, 2, [[0], [1]])
        with pytest.raises(PackError, match="the plan is for model 'cnn', not 'vit'"):
            c.partition("vit", plan=plan)
        with pytest.raises(PackError, match="another graph"):
            c.partition("vit", plan={**plan, "model": "vit@1"})
        elsewhere = {**plan, "stages": [{**s, "worker_names": ["gpu-3"]} for s in plan["stages"]]}
        with pytest.raises(InputError, match="worker 'gpu-3', which this daemon does not have"):
            c.partition("cnn", plan=elsewhere)
        assert c.describe("cnn").stages == []     # nothing was changed by the refusals
