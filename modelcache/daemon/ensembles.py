"""Triton ensembles whose steps are all models served here: stored beside the repository, run by the daemon.

An ensemble (`platform: "ensemble"`, `ensemble_scheduling { step [...] }`) names no weights of its own: its
steps are models, and tensors flow between them by name (`input_map`: the step model's input <- an ensemble
tensor; `output_map`: the step model's output -> an ensemble tensor). Here:
- `Ensemble` (executor/ensemble.py) is one version's definition, its wiring checked.
- `EnsembleStore` keeps them in the repository's `.ensembles/` directory (`NAME@VERSION.json`, the Triton
  configuration as JSON), so they survive restarts; `modelcache rm` removes one.
- `Ensembles.run` is one request's pipeline: each step goes as soon as its inputs exist, as a request of its
  model on the daemon's engine (`serve`, daemon/serving.py) — batched with that model's own requests, under
  the ensemble request's deadline — and the ensemble answers with the outputs asked for once every step is
  done, or with the first step's error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import InputError, ModelCacheError, ModelNotFound, from_code
from ..executor.ensemble import Ensemble, Step
from ..storage import storage_errors, write_atomic
from ..wire import protocol as P
from .registry import blank_listing

log = logging.getLogger("modelcache.daemon")

ENSEMBLES_DIR = ".ensembles"   # in the repository; names starting with "." are not model directories


class EnsembleStore:
    """`<repository>/.ensembles/NAME@VERSION.json`: {"config": ..., "owner_uid": ...}, written atomically."""

    def __init__(self, repository_root: Path):
        self.dir = Path(repository_root) / ENSEMBLES_DIR

    def load(self) -> dict:
        """name -> version -> Ensemble, of every file that can be read."""
        out: dict = {}
        if not self.dir.is_dir():
            return out
        for path in sorted(self.dir.glob("*@*.json")):
            name, _, version = path.stem.rpartition("@")
            try:
                d = json.loads(path.read_text())
                e = Ensemble.of(name, int(version), d["config"], int(d.get("owner_uid", -1)))
            except (OSError, ValueError, KeyError, TypeError, ModelCacheError) as e:   # one bad file: that one only
                log.error("ensemble %s: %s cannot be used: %s", path.stem, path, e)
                continue
            out.setdefault(e.name, {})[e.version] = e
        return out

    def put(self, e: Ensemble) -> None:
        path = self.dir / f"{e.key}.json"
        with storage_errors(f"storing ensemble {e.key}", path):
            self.dir.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps({"config": e.config, "owner_uid": e.owner_uid}, indent=1), durable=True)

    def remove(self, e: Ensemble) -> None:
        path = self.dir / f"{e.key}.json"
        with storage_errors(f"removing ensemble {e.key}", path):
            path.unlink(missing_ok=True)


class Ensembles:
    """The daemon's ensembles: add, describe, list, remove, and each request's pipeline (on the owner loop).
    `resolve(name, version)` is the registry's model lookup; `model_names()` the models' names; `serve` runs one
    request of a model (Serving.serve)."""

    def __init__(self, store: EnsembleStore, resolve, model_names, admins):
        self.store = store
        self.resolve = resolve
        self.model_names = model_names
        self.admins = admins
        self.table: dict = store.load()   # name -> version -> Ensemble (by name: `find` runs on every request)
        self.serve = None                 # set by Serving

    def find(self, name: str, version: int | None) -> Ensemble | None:
        """The ensemble a request names, when the name is an ensemble's (a model of that name wins)."""
        versions = self.table.get(name)
        if not versions or name in self.model_names():
            return None
        e = versions[max(versions)] if version is None else versions.get(version)
        if e is None:
            raise ModelNotFound(f"ensemble {name} has no version {version}; it has {sorted(versions)}")
        return e

    def listing(self) -> list[dict]:
        """As ListModels lists a model: tier "ensemble" (it holds no weights; its steps' models are listed)."""
        return [blank_listing(e.name, e.version, tier="ensemble", state="ready",
                              why=f"ensemble of {', '.join(s.model for s in e.order())}",
                              steps=[s.model for s in e.steps])
                for name in sorted(self.table) for _, e in sorted(self.table[name].items())]

    def describe(self, e: Ensemble, req_id: int) -> P.DescribeReply:
        return P.DescribeReply(req_id=req_id, name=e.name, version=e.version, inputs=e.io("input"),
                               outputs=e.io("output"), model_config=e.config)

    def on_AddEnsemble(self, ident, msg: P.AddEnsemble):
        e = Ensemble.of(msg.name, msg.version, msg.config, -1 if ident.uid is None else ident.uid)
        if msg.name in self.model_names():
            raise InputError(f"{msg.name} is a model's name; an ensemble needs a name of its own")
        stored = self.table.get(e.name, {}).get(e.version)
        if stored is not None:
            if stored.config == e.config:
                return P.Ack(req_id=msg.req_id)
            raise InputError(f"ensemble {e.key} already exists with another configuration; remove it first "
                             f"(`modelcache rm {e.name} --version {e.version}`)")
        for s in e.steps:   # every step a model served here, now
            model = self.resolve(s.model, s.version)
            if (model.manifest.serving or {}).get("sequence"):
                raise InputError(f"{e.name}: {s.label} is a stateful model (sequence batching); ensembles of "
                                 "stateful models are not served")
            why = s.unmapped({i.name for i in model.manifest.inputs + model.manifest.overridable},
                             {o.name for o in model.manifest.outputs}, model.key)
            if why:
                raise InputError(f"{e.name}: {why}")
        self.store.put(e)   # stored first: one that cannot be written is not served either
        self.table.setdefault(e.name, {})[e.version] = e
        log.info("ensemble added: %s (%s)", e.key, " -> ".join(s.model for s in e.order()))
        return P.Ack(req_id=msg.req_id)

    def remove(self, ident, msg: P.Remove) -> P.Ack | None:
        """Remove an ensemble `modelcache rm` names; None when it names no ensemble."""
        e = self.table.get(msg.name, {}).get(msg.version)
        if e is None or msg.name in self.model_names():
            return None
        self.admins.check_owner(ident, e.key, e.owner_uid, "remove")
        self.store.remove(e)
        del self.table[e.name][e.version]
        if not self.table[e.name]:
            del self.table[e.name]
        log.info("ensemble removed: %s", e.key)
        return P.Ack(req_id=msg.req_id)

    def run(self, e: Ensemble, feeds: dict, output_names: list | None, arrival: float, deadline: float | None,
            answer, priority: int | None = None) -> None:
        """One request of the ensemble: `answer(outputs, timings, error)` once (see the module's docstring). Each
        step's request has the ensemble request's priority, as in Triton's ensemble scheduler."""
        missing = [n for n in e.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in e.input_names]
        if missing or unknown:
            raise InputError(f"{e.name}: " + (f"missing input {missing[0]!r}" if missing else
                                              f"unknown input {unknown[0]!r}") + f"; the ensemble takes {e.input_names}")
        if output_names:
            bad = [n for n in output_names if n not in e.output_names]
            if bad:
                raise InputError(f"{e.name}: unknown output {bad[0]!r}; the ensemble has {e.output_names}")
        _Run(self, e, dict(feeds), output_names or e.output_names, arrival, deadline, answer, priority).advance()


class _Run:
    """One ensemble request in flight: its tensors so far and the steps not yet done."""

    def __init__(self, ensembles: Ensembles, e: Ensemble, tensors: dict, wanted: list, arrival, deadline, answer,
                 priority: int | None):
        self.ensembles, self.e, self.tensors, self.wanted = ensembles, e, tensors, wanted
        self.arrival, self.deadline, self.answer, self.priority = arrival, deadline, answer, priority
        self.waiting = list(e.order())
        self.running = 0
        self.timings: dict = {}
        self.failed = False

    def advance(self) -> None:
        for step in [s for s in self.waiting if all(t in self.tensors for _, t in s.inputs)]:
            if self.failed:
                return
            if step not in self.waiting:   # (started meanwhile, by a step that finished at once)
                continue
            self.waiting.remove(step)
            self.running += 1
            feeds = {name: self.tensors[tensor] for name, tensor in step.inputs}
            try:
                model = self.ensembles.resolve(step.model, step.version)
                self.ensembles.serve(model, feeds, [name for name, _ in step.outputs], self.arrival, self.deadline,
                                     None, lambda result, timings, error, step=step: self.done(step, result, error),
                                     self.priority)
            except ModelCacheError as e:
                self.done(step, None, e)
        if not self.waiting and not self.running and not self.failed:
            self.answer({n: self.tensors[n] for n in self.wanted}, self.timings, None)

    def done(self, step: Step, result, error) -> None:
        self.running -= 1
        if self.failed:
            return
        if error is not None:
            self.failed = True
            # (the step's own kind of error: a step's bad input is the request's bad input)
            code = getattr(error, "code", "run")
            self.answer(None, {}, from_code(code, f"{self.e.name}: {step.label}: {error}"))
            return
        for name, tensor in step.outputs:
            self.tensors[tensor] = result[name]
        self.advance()
