"""Rules over the training's setup, judged once, at the first step: the output layer, the loss and the labels.

They read what the plugin saw of the first step (`run.first_step`, tripwire.core.firststep): each loss, how it
reads its input, what produced that input, and the labels. These bugs cost nothing to find before the model has
learned anything, and everything the other rules see later (a loss that does not go down, vanishing gradients)
follows from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..firststep import RANGES
from .base import FIRST_LABELS, NotApplicable, Rule
from .given import classes_given, swapped_message

MIN_BATCH = 32  # a first batch of this many labels, all of one class among three or more, is no chance


@dataclass
class LossSetup(Rule):
    """An output layer, a loss and labels that do not fit each other."""

    name = "loss_setup"
    modes = ("train",)
    condition = ("at the first step, for each loss the training step used: a softmax over one unit feeds it (error: "
                 "the output is always 1, nothing learns); a softmax or sigmoid output feeds a loss that applies it "
                 "again (CrossEntropyLoss, BCEWithLogitsLoss, from_logits=True); an output that is not probabilities "
                 "(linear, ReLU, tanh) feeds a loss that reads probabilities (from_logits=False, BCELoss); a "
                 "sigmoid over several units feeds a categorical loss on probabilities (the classes do not "
                 "compete: a softmax was meant); an output "
                 "other than log_softmax feeds NLLLoss; a bounded output (sigmoid, softmax, tanh, ReLU) feeds a "
                 "regression loss whose targets lie outside its range; a softmax or one-hot targets under a "
                 "regression loss (classes learned by mean squared error), or 0/1 targets of one output under "
                 "mean absolute error; a softmax or log_softmax that feeds a categorical loss over another axis "
                 "than the one it reads the classes along (dim=0: across the batch; torch); a categorical loss whose "
                 "rows of C scores are a view of a tensor whose C classes lie along an axis with more after it "
                 "((B, C, T) viewed as (-1, C), not permuted first; torch); predictions and targets "
                 "of an element-wise loss whose shapes broadcast "
                 "into more elements than the predictions hold ((N, 1) against (N,): error, the loss compares every "
                 "prediction with every target; torch); labels that are not class ids for a loss "
                 "that takes ids, class ids beyond the outputs, binary targets outside [0, 1], or a first batch of "
                 "32 or more labels all of one class among three or more (data ordered by class, not shuffled; not "
                 "where another call of the loss in the step saw another class: a sequence's loss per time step), "
                 "or 32 or more one-hot rows of three or more classes under a binary loss (info: single-label "
                 "classes learned as separate yes/no questions, which trains, with an accuracy that reads high); "
                 "a class weight of 0 for two or more classes (never learned; Keras' class_weight, torch's "
                 "CrossEntropyLoss(weight=...)); validation "
                 "labels of classes the training labels never hold, 5 % of them or more (validation_split on data "
                 "ordered by class; "
                 "Keras, from the arrays fit was given); validation columns that are the training's in another "
                 "order: two or more columns of 5 or more values whose mean lies more than 1.5 standard "
                 "deviations from the training column of their index and within sampling error of another's, with "
                 "a spread within 1.3x of it, closing into a permutation (Keras' and XGBoost's numpy data)")
    hint = ("The output layer, the loss and the labels must agree on what the output is: logits for "
            "CrossEntropyLoss / BCEWithLogitsLoss / from_logits=True, probabilities for BCELoss / from_logits=False, "
            "log-probabilities for NLLLoss; a bounded activation only for targets within its range; class ids for a "
            "sparse loss, one-hot rows for a categorical one; predictions and targets of one shape for an element-wise "
            "loss (mean squared error). The message names the change to make.")
    source = ("DeepDiagnosis (Wardat et al., ICSE 2022) and AUTOTRAINER list a wrong last-layer activation for the "
              "loss and wrongly encoded labels among the commonest training bugs (Islam et al., FSE 2019); "
              "DeepDiagnosis reads them from the program, here from what the framework ran at the first step.")

    def __post_init__(self):
        self._done: set = set()

    def requires(self):
        # the first batch's labels, which a plugin that cannot see them with the loss (Keras) takes from the capture
        return [FIRST_LABELS]

    def check(self, run, step):
        if run.default_worker in self._done:
            return None
        first = run.first_step
        if first is None:
            if run.model is None:  # a booster, or a run from before first steps were recorded: not this rule's
                return None
            raise NotApplicable("the plugin recorded nothing of the loss at the first step (training began before "
                                "tripwire was attached, or the loss is computed where the plugin cannot see it)")
        self._done.add(run.default_worker)
        found = []
        for use in first.losses:
            for finding, severity, message in _problems(use):
                if finding == "one_class_batch" and not _one_class_throughout(first.losses, use):
                    continue
                found.append(self.fire(step, f"{_name(use)}: {message}", severity=severity, finding=finding,
                                       onset=first.step, loss=use.loss, output=use.output, units=use.units,
                                       settings=use.settings))
        if first.column_swaps:
            found.append(self.fire(step, swapped_message(first.column_swaps), severity="warning",
                                   finding="columns_swapped", onset=first.step,
                                   columns=[list(pair) for pair in first.column_swaps]))
        return found or None


def _one_class_throughout(uses, use) -> bool:
    """Whether every call of this loss at the first step saw the one class this call did: a sequence model's loss
    per time step sees at its first the same start token in every sample, and its batch holds many classes."""
    return all(other.labels.distinct == 1 and other.labels.min == use.labels.min for other in uses
               if other.loss == use.loss and other.units == use.units and other.labels is not None)


def _broadcast(use) -> tuple | None:
    """The shape an element-wise loss computed over where its predictions and targets broadcast into more elements
    than the predictions hold ((N, 1) against (N,): N x N), else None."""
    if use.kind != "regression" or use.input_shape is None or use.labels is None:
        return None
    try:
        spread = np.broadcast_shapes(tuple(use.input_shape), tuple(use.labels.shape))
    except ValueError:  # shapes the framework itself refuses
        return None
    return spread if math.prod(spread) > math.prod(use.input_shape) else None


def _name(use) -> str:
    settings = ", ".join(f"{k}={v}" for k, v in use.settings.items() if k in ("from_logits", "targets"))
    return f"{use.loss}({settings})" if settings else use.loss


def _classes_not_last(use) -> str | None:
    """A categorical loss's rows of C scores viewed from a tensor whose C classes lay along an axis with more
    after it ((B, C, T) viewed as (-1, C), not permuted first: Karpathy's 'view vs transpose'): each row holds
    scores of one class at several positions, so the loss trains nothing it means, at chance."""
    shape, source = use.input_shape, use.reshaped_from
    if use.kind != "categorical" or not shape or not source or len(shape) != 2 or shape[1] < 2 or \
            source[-1] == shape[1]:
        return None
    classes = shape[1]
    axis = next((i for i in range(1, len(source) - 1) if source[i] == classes and
                 math.prod(source[i + 1:]) > 1), None)
    if axis is None:
        return None
    order = ", ".join(["0", *(str(i) for i in range(1, len(source)) if i != axis), str(axis)])
    return (f"its rows of {classes} class scores are a view of a tensor of shape {source}, whose {classes} classes "
            f"lie along axis {axis}, not the last: each row mixes one class's scores at several positions, and the "
            f"loss learns nothing it means. Move the classes last before the view (x.permute({order})"
            f".reshape(-1, {classes})), or hand the loss the (N, C, …) tensor as it is.")


def _problems(use):
    """(finding, severity, message) for each way this loss, its input and its labels do not fit."""
    out, labels, output = [], use.labels, use.output
    if use.over_one:
        out.append(("one_unit_softmax", "error", "its input is a softmax over a single unit, which is 1 whatever "
                    "the model computes: the loss has no gradient and nothing learns. Use a sigmoid for one output "
                    "unit (or BCEWithLogitsLoss / from_logits=True on the raw output), or one unit per class."))
    elif use.reads == "logits" and output in ("softmax", "sigmoid"):
        out.append(("applied_twice", "warning", f"the output goes through a {output}, and the loss applies "
                    f"{output} again: the model learns slowly or not at all. Remove the output's {output} (keep it "
                    "for prediction), or use a loss on probabilities (from_logits=False)."))
    elif use.reads == "probabilities" and output in ("linear", "relu", "tanh"):
        out.append(("not_probabilities", "warning", f"the loss reads its input as probabilities, but the output "
                    f"is {'raw logits' if output == 'linear' else f'a {output}'}: the loss clips it and computes "
                    "something else. Pass from_logits=True (or use BCEWithLogitsLoss / CrossEntropyLoss), or put a "
                    "softmax/sigmoid on the output."))
    elif use.reads == "probabilities" and output == "sigmoid" and use.kind == "categorical" and \
            (use.units or 0) >= 2:
        out.append(("sigmoid_for_classes", "warning", f"the output is a sigmoid over {use.units} units, whose "
                    "values do not sum to 1, and the loss reads them as one distribution over the classes (divided "
                    "by their sum, or clipped): the classes do not compete, and the model learns something else. "
                    "Use a softmax on the output (or from_logits=True on the raw output); a sigmoid with binary "
                    "cross-entropy is for labels that can be true together."))
    elif use.reads == "log_probabilities" and output in ("softmax", "sigmoid", "linear"):
        out.append(("not_log_probabilities", "warning", f"the loss reads log-probabilities, but the output is "
                    f"{'raw logits' if output == 'linear' else f'a {output}'}. Use log_softmax on the output, or "
                    "CrossEntropyLoss on the logits."))
    moved = _classes_not_last(use)
    if moved is not None:
        out.append(("classes_reshaped", "warning", moved))
    if use.softmax_axis is not None and use.class_axis is not None and use.softmax_axis != use.class_axis:
        across = "the samples of the batch" if use.softmax_axis == 0 else f"axis {use.softmax_axis}"
        out.append(("softmax_axis", "warning", f"the output's {use.output} normalises over {across} (dim="
                    f"{use.softmax_axis}), and the loss reads the classes along dim={use.class_axis}: each class's "
                    "scores are made to compete across "
                    f"{'samples' if use.softmax_axis == 0 else 'that axis'} instead of the classes within each "
                    f"sample. Use dim={use.class_axis}."))
    spread = _broadcast(use)
    if spread is not None:
        out.append(("broadcast", "error", f"the predictions (shape {tuple(use.input_shape)}) and the targets (shape "
                    f"{tuple(labels.shape)}) differ in shape, and the loss broadcasts them against each other into "
                    f"{tuple(spread)}: it compares each prediction with every target, and the model learns their "
                    "mean. Give both one shape: prediction.squeeze(-1), or target.unsqueeze(-1) / "
                    "view_as(prediction)."))
    if use.kind == "regression" and labels is not None:
        low, high = RANGES.get(output, (float("-inf"), float("inf")))
        if labels.min < low - 1e-6 or labels.max > high + 1e-6:
            out.append(("unreachable_targets", "warning", f"the output is a {output}, which stays within [{low:g}, "
                        f"{high:g}], but the targets run from {labels.min:.4g} to {labels.max:.4g}: the model can "
                        "never reach them. Use a linear output for these targets (or scale the targets into the "
                        "range)."))
        if output == "softmax" or labels.one_hot:
            out.append(("classes_by_regression", "warning", "classes are learned with a regression loss (mean "
                        "squared or absolute error on a softmax or on one-hot targets): its gradient vanishes as "
                        "the outputs saturate. Use cross-entropy on the logits."))
        elif use.loss == "l1_loss" and (use.units or 1) == 1 and labels.integer and labels.distinct == 2 and \
                labels.min == 0 and labels.max == 1:
            out.append(("classes_by_regression", "warning", "yes/no targets (0 and 1) are learned with mean "
                        "absolute error: its gradient is the same for every sample on the wrong side, and predicting "
                        "any constant between 0 and 1 scores the same on balanced labels, so the model can stay "
                        "where it starts (XOR at 0.5). Use binary cross-entropy (BCEWithLogitsLoss, "
                        "binary_crossentropy) on a sigmoid output, or mean squared error."))
        elif _class_ids(labels) and (use.units or 1) == 1:
            out.append(("classes_by_regression", "warning", f"the targets are the class ids 0 to "
                        f"{labels.max:.0f}, every one of them present, learned as one number by a regression loss: "
                        "the model is taught that class 3 lies between classes 2 and 4. Use one output per class "
                        "and cross-entropy (for XGBoost, multi:softprob with num_class)."))
    if use.kind == "categorical" and labels is not None:
        out += _class_labels(use, labels)
    if use.kind in ("categorical", "binary"):
        out += classes_given(use)
    if use.kind == "binary" and labels is not None and labels.one_hot and labels.shape[-1] >= 3 and \
            labels.shape[0] >= MIN_BATCH:
        out.append(("one_label_per_row", "info", f"every one of the first batch's {labels.shape[0]} label rows "
                    f"holds exactly one of {labels.shape[-1]} classes, learned by a binary loss as "
                    f"{labels.shape[-1]} separate yes/no questions: the classes do not compete, and its accuracy "
                    "reads high while the model predicts no class. For one class per sample use a softmax output "
                    "and categorical cross-entropy; keep sigmoid and binary cross-entropy for labels that can be "
                    "true together."))
    if use.kind == "binary" and labels is not None and (labels.min < 0 or labels.max > 1):
        out.append(("binary_targets", "warning", f"a binary loss with targets from {labels.min:.4g} to "
                    f"{labels.max:.4g}: it expects 0 or 1 (or a probability). Map the labels to 0/1, or use a "
                    "categorical loss for more than two classes."))
    elif use.kind == "binary" and labels is not None and not labels.integer and labels.max < 0.5:
        out.append(("binary_targets", "warning", f"a binary loss whose targets never reach 0.5 (from "
                    f"{labels.min:.4g} to {labels.max:.4g}): no sample is of the positive class. Labels scaled like "
                    "inputs (divided by 255?): give 0 and 1."))
    return out


def _class_ids(labels) -> bool:
    """Targets that are 0, 1, … K-1, each present, for 5 <= K <= 20: class ids, not measurements (ordinal ratings
    start elsewhere, counts leave values out)."""
    return labels.integer and labels.min == 0 and labels.max == labels.distinct - 1 and 5 <= labels.distinct <= 20


def _class_labels(use, labels):
    shaped_as_ids = len(labels.shape) <= 1 or labels.shape[-1] == 1
    if use.settings.get("targets") != "ids" and (not shaped_as_ids or use.settings.get("targets") == "one_hot"):
        return []  # one-hot or soft rows (Keras refuses class ids for a categorical loss itself)
    if not labels.integer:
        return [("not_class_ids", "warning", f"the loss takes class ids, but the labels are not whole numbers "
                 f"(from {labels.min:.4g} to {labels.max:.4g}): they are cast to integers and most become one class "
                 "(labels scaled like inputs, e.g. divided by 255?). Give the class ids as they are.")]
    ignored = use.settings.get("ignore_index", -100)  # padding a loss leaves out
    if (use.units and labels.max >= use.units) or (labels.min < 0 and labels.min != ignored):
        return [("ids_out_of_range", "warning", f"class ids run from {labels.min:.4g} to {labels.max:.4g}, but "
                 f"the output has {use.units} units: ids must lie in 0..{(use.units or 1) - 1}. Check the number "
                 "of output units and the label encoding.")]
    if labels.distinct == 1 and (use.units or 0) >= 3 and shaped_as_ids and labels.shape[0] >= MIN_BATCH:
        return [("one_class_batch", "warning", f"the first batch's {labels.shape[0]} labels are all class "
                 f"{labels.min:.0f}, of {use.units}: data ordered by class and not shuffled trains on one class at "
                 "a time, and a dataset whose __getitem__ ignores its index hands out one sample only. Shuffle the "
                 "training data (shuffle=True in the DataLoader or fit); check that __getitem__ uses its index.")]
    return []
