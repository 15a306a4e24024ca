"""Rules that compare the run being trained with another run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import TripwireError, listing
from ..naming import SCALAR_COLLECTIONS, collection_of
from ..reductions import DEFAULT_REDUCTIONS
from .base import Requirement, Rule


@dataclass
class SimilarAcrossRuns(Rule):
    """This run departs from a reference run at the same step, by `tripwire compare`'s comparison.

    For migrations and refactors: a run that no longer computes what the reference computed, because of a changed
    hyperparameter or schedule, other initial weights, data order or precision, or a code change in one layer.
    The verdict names the tensors that differ at the first such step, earliest in compute order first."""

    reference: str = ""  # URL of the reference run (required)
    collections: list = field(default_factory=lambda: ["optimizer", "weights", "biases", "gradients", "losses"])
    regex: str = ""  # compare only tensors whose names (in this run's naming) match this (re.search)
    atol: float = 1e-5
    rtol: float = 0.05
    switch_step: int = 10
    name_map: str = ""  # a name map file renaming the reference's tensors into this run's names

    name = "similar_across_runs"
    required = ("reference",)
    modes = ("train", "eval")
    condition = ("at the step evaluated, a tensor of `collections` held by both this run and the `reference` run "
                 "differs beyond tolerance: |a - b| > atol at steps <= switch_step, relative error > rtol after "
                 "(NaN never agrees); full values where both saved them, else every reduction both captured")
    hint = ("This run computes something different from the reference from this step on; the tensor named first "
            "is the earliest in the model's compute order. Likely causes: a changed hyperparameter or schedule "
            "(check optimizer/ first), different initial weights or seed, a different data order or augmentation, "
            "a code change in the layer named, another precision (fp16/bf16/TF32) or nondeterministic kernels. Try: "
            "`tripwire compare REFERENCE RUN` for the full report; fix seeds and the data order; "
            "torch.use_deterministic_algorithms(True); loosen atol/rtol if the differences are float noise.")
    source = ("smdebug SimilarAcrossRuns (tensors of two trials compared with numpy.allclose at each step); here "
              "with tripwire compare's tolerance schedule (atol 1e-5 up to step 10, rtol 0.05 after) and name map.")

    def __post_init__(self):
        self._reference_run = None
        self._map = None

    def requires(self):
        return [Requirement(c, () if c in SCALAR_COLLECTIONS else DEFAULT_REDUCTIONS) for c in self.collections]

    def check(self, run, step):
        from ..compare import compare
        from ..namemap import load_name_map
        from ..run import open_run

        if not self.reference:
            raise TripwireError("similar_across_runs needs `params: {reference: URL}`, the run to compare with.")
        if self._reference_run is None:
            self._reference_run = open_run(self.reference)
            self._map = load_name_map(self.name_map or None)
        pattern = re.compile(self.regex) if self.regex else None
        result = compare(run, self._reference_run, atol=self.atol, rtol=self.rtol, switch_step=self.switch_step,
                         name_map=self._map, modes=[run.default_mode], steps=[step],
                         workers=None if run.default_worker is None else [run.default_worker],
                         tensors=lambda n: collection_of(n) in self.collections and (
                             pattern is None or pattern.search(n) is not None))
        if not result.tensors and run.default_mode == "train":
            raise TripwireError(f"no tensor of collections {', '.join(self.collections)} is in both this run and "
                                f"the reference {self.reference}, which holds "
                                f"{listing(self._reference_run.tensor_names())}. Pair them with `name_map`.")
        if not result.diverged:
            return None
        here = result.diverging
        more = f"; so do {len(here) - 1} more tensors" if len(here) > 1 else ""
        return self.fire(step, f"{here[0].name} differs from the reference run {self.reference} at step {step} "
                               f"(max abs {here[0].max_abs:.3g}, max rel {here[0].max_rel:.3g}){more}.",
                         reference=self.reference,
                         tensors={d.name: {"max_abs": d.max_abs, "max_rel": d.max_rel} for d in here})
