"""Rules over the data fed to the model."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ranges import COUNT, Range
from .base import NotApplicable, Requirement, Rule

STATISTICS = ("mean", "std", "min", "max")


def scaled_by_model(run, per_feature: bool = False) -> None:
    """Raise NotApplicable where the model's first layer rescales or normalises the inputs itself (Keras'
    Rescaling(1/255) or Normalization, a BatchNorm first): their raw scale is then what the model expects; and,
    for their overall scale, where the first layer's output is normalised next (a Dense, then a BatchNorm).
    per_feature: only a layer that normalises each feature counts (Rescaling scales them all alike)."""
    scaled = run.model.inputs_scaled if run.model is not None else ""
    if scaled and not (per_feature and scaled == "Rescaling"):
        raise NotApplicable(f"the model's first layer ({scaled}) rescales or normalises the inputs itself")
    kernels = run.model.kernels(trainable=None) if run.model is not None else []
    if not per_feature and kernels and kernels[0].scale_free:  # Dense -> BatchNorm: no scale of x reaches past it
        raise NotApplicable(f"the model's first layer ({kernels[0].layer_class}) is normalised next, which takes "
                            "the inputs' scale out")


@dataclass
class InputNotNormalized(Rule):
    """Inputs on a scale far from the unit one (raw pixels 0-255, raw measurements), which slows or breaks training."""

    max_mean: float = 5.0
    max_std: float = 10.0  # polynomial features x..x^4 of a standard normal x spread 8 and train
    samples: int = 3  # batches pooled before the rule decides

    name = "input_not_normalized"
    # a risk, not a fault: many models train on raw pixels or counts (Adam, a normalisation inside). On its own it
    # is worth a look; where training suffers from it (huge gradients, steps, a loss that does not fall) the
    # diagnosis names it as the cause of those warnings
    severity = "info"
    limits = {"samples": COUNT}
    condition = ("over the newest `samples` sampled batches of the inputs, the first `samples` steps' first "
                 "(collection `inputs`: float inputs, and Keras' integer inputs where no layer reads them as ids, "
                 "such as uint8 pixels; token ids are not captured), pooled: values outside [-1, 1] (data scaled "
                 "to [0, 1] or [-1, 1] is normalised) with a mean further than `max_mean` from 0 or a standard "
                 "deviation above `max_std`. Not judged where the model's first layer rescales or normalises the "
                 "inputs itself (Keras' Rescaling(1/255) or Normalization, a BatchNorm first), or where its output "
                 "is normalised next (a Dense, then a BatchNorm: no scale of the inputs gets past it)")
    hint = ("The inputs are not normalised, so early layers see badly scaled values (saturation, huge gradients, "
            "slow training). Try: standardise each feature with the training set's mean and std, or scale images "
            "to [0, 1] (divide by 255) and then normalise per channel; make sure the same transform is applied at "
            "evaluation.")
    source = ("smdebug CheckInputImages (|mean| > 0.2) and DeepDiagnosis (Wardat et al., ICSE 2022: inputs outside "
              "[-1, 1]) fire on images scaled to [0, 1], on one-hot features and on one small batch's mean; here "
              "bounded data is accepted and the scale is judged over several batches, against bounds that "
              "standardised data keeps.")

    @property
    def history(self):
        return self.samples

    def requires(self):
        # the first batches too, where raw inputs first show: a run of a few dozen steps is judged as well
        return [Requirement("inputs", STATISTICS, steps=tuple(range(self.samples)))]

    def check(self, run, step):
        scaled_by_model(run)
        found = []
        for name in run.tensor_names("inputs", step=step):
            tensor = run.tensor(name)
            if not set(STATISTICS) <= set(tensor.reductions()):
                continue
            tails = {r: tensor.tail(r, self.samples) for r in STATISTICS}
            steps = tails["mean"][0]
            if len(steps) < self.samples or steps[-1] != step or any(t[0] != steps for t in tails.values()):
                continue
            means, stds, lows, highs = (tails[r][1] for r in STATISTICS)
            if not all(math.isfinite(v) for t in tails.values() for v in t[1]):
                continue  # NaN in the inputs is exploding_tensor's
            if min(lows) >= -1.0 and max(highs) <= 1.0:
                continue
            mean = sum(means) / len(means)
            std = math.sqrt(max(sum(s * s + m * m for s, m in zip(stds, means)) / len(means) - mean * mean, 0.0))
            if abs(mean) > self.max_mean or std > self.max_std:
                found.append(self.fire(step, f"{name} has mean {mean:.3g} and std {std:.3g} over its last "
                                             f"{self.samples} sampled batches (values from {min(lows):.3g} to "
                                             f"{max(highs):.3g}); normalised data keeps its mean within "
                                             f"±{self.max_mean:g} and its std below {self.max_std:g}.",
                                       finding=name, onset=steps[0], tensor=name, mean=mean, std=std))
        return found or None


@dataclass
class InputFeatures(Rule):
    """Tabular inputs whose features lie on scales far apart, or hold one value across the first batch."""

    max_ratio: float = 1000.0
    listed: int = 10  # features named in a message

    limits = {"max_ratio": Range(1, low_open=True, what="a ratio"), "listed": COUNT}
    name = "input_features"
    modes = ("train",)
    condition = ("at the first step, for each float input of samples x features (collection `inputs`, the first "
                 "batch saved whole): the largest feature's magnitude (its max |x| over the batch) is more than "
                 "`max_ratio` times the smallest non-zero one (warning, finding `<input>:scales`); features that "
                 "hold one value across the batch (info, finding `<input>:constant`). Not judged where the model's "
                 "first layer normalises each feature itself (Keras' Normalization, a BatchNorm first)")
    hint = ("The features are on very different scales, so the large ones dominate the first layer's sums and "
            "its gradients while the small ones barely move it. Try: standardise each feature with the training "
            "set's mean and std (sklearn's StandardScaler, keras.layers.Normalization adapted to the training "
            "data), or log-scale features that span orders of magnitude; apply the same transform at evaluation.")
    source = ("DeepDiagnosis (Wardat et al., ICSE 2022) and AUTOTRAINER judge the inputs as one tensor (its mean, "
              "its range), which misses a table of one feature in the thousands beside features in [0, 1]; here "
              "each feature's scale is judged against the others, once, on the first batch. Trees do not care "
              "about feature scales: boosters are not judged.")

    def __post_init__(self):
        self._done: set = set()

    def requires(self):
        return [Requirement("inputs", save_tensors=True, steps=(0,), optional=True)]

    def check(self, run, step):
        scaled_by_model(run, per_feature=True)
        found = []
        for name in run.tensor_names("inputs"):
            tensor = run.tensor(name)
            saved = tensor.steps(tensors=True)
            if (run.default_worker, name) in self._done or not saved:
                continue
            self._done.add((run.default_worker, name))
            found += self._judge(name, np.asarray(tensor.value(saved[0]), dtype=np.float64), saved[0], step)
        return found or None

    def _judge(self, name: str, batch: np.ndarray, first: int, step: int) -> list:
        if batch.ndim != 2 or batch.shape[0] < 2 or batch.shape[1] < 2:
            return []  # images, sequences, one feature: not a table of features
        finite = np.where(np.isfinite(batch), batch, np.nan)  # NaN/Inf is exploding_tensor's
        with np.errstate(all="ignore"):
            magnitude = np.nanmax(np.abs(finite), axis=0)
            spread = np.nanmax(finite, axis=0) - np.nanmin(finite, axis=0)
        found = []
        constant = np.flatnonzero(spread == 0)
        if constant.size:
            found.append(self.fire(step, f"{name}: {constant.size} of {batch.shape[1]} features hold one value "
                                         f"across the first batch of {batch.shape[0]} (features "
                                         f"{_listed(constant, self.listed)}): they carry nothing to learn from "
                                         "there; drop them if they are constant in the whole training set.",
                                   severity="info", finding=f"{name}:constant", onset=first, tensor=name,
                                   features=constant[:self.listed].tolist(), count=int(constant.size)))
        live = np.flatnonzero((magnitude > 0) & (spread > 0))
        if live.size >= 2:
            large, small = live[np.argmax(magnitude[live])], live[np.argmin(magnitude[live])]
            ratio = magnitude[large] / magnitude[small]
            if ratio > self.max_ratio:
                wide = live[magnitude[live] > magnitude[small] * self.max_ratio]
                found.append(self.fire(step, f"{name}: feature {large} reaches {magnitude[large]:.3g} and feature "
                                             f"{small} only {magnitude[small]:.3g} in the first batch, {ratio:.3g}x "
                                             f"apart (limit {self.max_ratio:g}x); {wide.size} feature(s) are over "
                                             f"{self.max_ratio:g}x the smallest: {_listed(wide, self.listed)}.",
                                       finding=f"{name}:scales", onset=first, tensor=name, ratio=float(ratio),
                                       largest=int(large), smallest=int(small)))
        return found


def _listed(indices: np.ndarray, most: int) -> str:
    shown = ", ".join(str(int(i)) for i in indices[:most])
    return shown + (f" and {indices.size - most} more" if indices.size > most else "")
