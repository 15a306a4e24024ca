"""From a config to what a plugin captures: the configured collections plus what the rules require.

A rule's `requires()` turns capture on: a collection no one configured captures
only what its rules read; reductions a rule reads only in a window of steps
(e.g. the first steps of training) are taken only there.
"""

from __future__ import annotations

from .naming import MODES, SCALAR_COLLECTIONS, VALUE
from .reductions import DEFAULT_REDUCTIONS
from .sampling import SCHEDULE_KEYS, CollectionPlan, Schedule

# Evaluation happens once per eval run at the global step it ran at, so eval and
# predict are sampled every time unless the config says otherwise.
DEFAULT_MODE_SAMPLING = {"eval": {"every": 1}, "predict": {"every": 1}}


def resolved_schedule(config, collection: dict, mode: str) -> Schedule:
    """A collection's schedule in a mode: collection-mode > collection > sampling-mode > sampling > defaults."""
    layers = [config.sampling, DEFAULT_MODE_SAMPLING.get(mode, {}), config.sampling.get("modes", {}).get(mode, {}),
              collection, collection.get("modes", {}).get(mode, {})]
    merged: dict = {"every": 100, "start": 0, "end": None, "steps": []}
    for layer in layers:
        merged.update({k: layer[k] for k in SCHEDULE_KEYS if k in layer})
    return Schedule(merged["every"], merged["start"], merged["end"], frozenset(merged["steps"]))


def plan_collections(config) -> dict[str, CollectionPlan]:
    """{collection: its plan} for a validated `tripwire.Config`."""
    wanted: dict[str, dict] = {name: dict(body) for name, body in config.collections.items()}
    everywhere: list = []  # reductions a rule wants on every tensor collection captured
    windows: dict[str, list] = {}  # collection -> [(steps, reductions)] read only at those steps
    for spec in config.rules:
        for req in spec.create().requires():
            if req.collection == "*":
                everywhere.extend(req.reductions)
                continue
            # a collection that only a rule asks for captures only what the rule needs
            body = wanted.setdefault(req.collection, {"reductions": [], "include": list(req.include)})
            body.setdefault("reductions", DEFAULT_REDUCTIONS)
            if req.steps:  # reductions and full tensors read only in a window of steps are taken only there
                windows.setdefault(req.collection, []).append(
                    (frozenset(req.steps), tuple(req.reductions), req.save_tensors))
            else:
                body["reductions"] = [*body["reductions"], *req.reductions]
                if req.save_tensors:
                    body["save"] = "tensors"
            if body.get("include") and req.include:  # patterns widen a selection; no patterns already take all
                body["include"] = list(dict.fromkeys([*body["include"], *req.include]))
    plans = {}
    for name, body in wanted.items():
        scalar = name in SCALAR_COLLECTIONS
        own = body.get("reductions", DEFAULT_REDUCTIONS)
        save_tensors = body.get("save") == "tensors" and not scalar
        if not (scalar or own or save_tensors):  # only read in a window of steps: sampled there alone
            body = {**body, "every": 0, "steps": [], "modes": {}}
        reductions = (VALUE,) if scalar else tuple(dict.fromkeys([*own, *everywhere]))
        plans[name] = CollectionPlan(
            name=name,
            reductions=reductions,
            save_tensors=save_tensors,
            schedules={m: resolved_schedule(config, body, m) for m in MODES},
            include=tuple(body.get("include", ())),
            exclude=tuple(body.get("exclude", ())),
            # a step sampled for a window is a sampled step: the reductions wanted everywhere (the NaN count
            # exploding_tensor reads) are taken there too
            windows=tuple((steps, (VALUE,) if scalar else tuple(dict.fromkeys([*extra, *everywhere])), save and not scalar)
                          for steps, extra, save in windows.get(name, ())),
        )
    return plans
