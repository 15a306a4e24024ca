"""What a plugin sees of the training at its first step: each loss, how it reads its input, what produced that input
(the output layer's activation), and the labels it compares them with.

Bugs of this kind are there before the model has learned anything: a softmax before a loss that applies it again,
logits into a loss that expects probabilities, a softmax over one unit, a sigmoid output for targets in the tens,
labels that are not class ids. Each plugin reads these facts from its framework once, at the first step (torch:
the loss functions the training step calls and the operations that produced their inputs; Keras: the compiled
loss and the output layer), and the recorder stores them in the run (`first_step/<worker>.json`), so that the
rules judge them in the training process, in `tripwire watch` and offline alike (tripwire.core.rules.setup).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

import numpy as np

# How each loss reads its input (canonical names, shared by the frameworks' spellings): as logits, as
# probabilities, as log-probabilities, or as values (a regression).
READS = {
    "cross_entropy": "logits", "binary_cross_entropy_with_logits": "logits", "multilabel_soft_margin_loss": "logits",
    "nll_loss": "log_probabilities", "kl_div": "log_probabilities",
    "binary_cross_entropy": "probabilities",
    "mse_loss": "values", "l1_loss": "values", "smooth_l1_loss": "values", "huber_loss": "values",
    # objectives known only by what they learn (XGBoost's): how they read the output is theirs
    "regression": "values", "binary": "scores", "multiclass": "scores", "ranking": "scores",
}
# What each loss learns: a class among several (ids, or one-hot / soft rows), a yes/no per output, or values.
KINDS = {
    "cross_entropy": "categorical", "nll_loss": "categorical", "kl_div": "distribution",
    "binary_cross_entropy": "binary", "binary_cross_entropy_with_logits": "binary",
    "multilabel_soft_margin_loss": "binary",
    "mse_loss": "regression", "l1_loss": "regression", "smooth_l1_loss": "regression", "huber_loss": "regression",
    "regression": "regression", "binary": "binary", "multiclass": "categorical", "ranking": "ranking",
}
ACTIVATIONS = ("softmax", "log_softmax", "sigmoid", "tanh", "relu", "linear")
# The values an output activation can take: what a regression's targets must lie within.
RANGES = {"sigmoid": (0.0, 1.0), "softmax": (0.0, 1.0), "tanh": (-1.0, 1.0), "relu": (0.0, float("inf"))}


@dataclass(frozen=True)
class Labels:
    """Statistics of the targets of the first batch."""

    dtype: str
    shape: tuple
    min: float
    max: float
    integer: bool  # every value a whole number
    distinct: int  # distinct values (counted up to 1000)
    one_hot: bool  # rows of zeros with a single one
    variance: float | None = None  # of the finite values: what predicting their mean scores under squared error
    # where every value lies in [0, 1]: their mean binary entropy, what predicting each exactly scores under binary
    # cross-entropy (its floor: 0 for labels of 0 and 1, well above it for soft targets, ratings scaled to [0, 1])
    entropy: float | None = None

    @classmethod
    def of(cls, array) -> Labels | None:
        """The statistics of an array of targets; None for an empty or non-numeric one."""
        a = np.asarray(array)
        if a.size == 0 or not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
            return None
        values = a.astype(np.float64, copy=False)
        finite = values[np.isfinite(values)]
        if finite.size == 0:
            return None
        one_hot = a.ndim >= 2 and a.shape[-1] >= 2 and bool(np.all((values == 0) | (values == 1))) and \
            bool(np.all(values.sum(axis=-1) == 1))
        entropy = None
        if finite.min() >= 0 and finite.max() <= 1:
            p = finite[(finite > 0) & (finite < 1)]  # a label of 0 or 1 has none
            entropy = float(np.sum(-(p * np.log(p) + (1 - p) * np.log1p(-p))) / finite.size)
        return cls(str(a.dtype), tuple(int(d) for d in a.shape), float(finite.min()), float(finite.max()),
                   bool(np.all(finite == np.round(finite))), min(len(np.unique(finite)), 1000), one_hot,
                   float(finite.var()), entropy)


@dataclass(frozen=True)
class LossUse:
    """One loss as the training step used it.

    loss: its canonical name (READS); reads: logits | probabilities | log_probabilities | values, or scores (an
    objective that reads its output its own way); kind: KINDS.
    output: the activation that produced its input (ACTIVATIONS: `linear` for none), None where unknown.
    units: the size of the input's class dimension (the outputs per sample), where it has one.
    over_one: the softmax that produced the input ran over a dimension of one unit (always 1).
    labels: the targets' statistics, where the plugin saw them with the loss.
    settings: the loss's own (from_logits, reduction, label_smoothing, …), as plain values.
    terms: how many terms the loss adds up, where its reduction sums them instead of taking their mean (torch's
        `reduction="sum"`, Keras' `"sum"`): its value and its gradients are that many times those of the mean.
        Each plugin counts them as its framework sums; None for a mean.
    bootstrapped: the targets were computed by the model itself, from its parameters (a DQN's temporal-difference
        target from its target network, a momentum encoder's or a teacher's output): they move as it trains, and
        the loss's level is no measure of the fit. A frozen network outside the model (a perceptual loss's VGG)
        computes data. None where the plugin cannot tell (torch tells).
    input_shape: the shape of the loss's input (the predictions) as the loss got it, where the framework hands it
        over as it is (torch; Keras brings predictions and targets to one rank first).
    softmax_axis, class_axis: for a categorical loss whose input a softmax or log_softmax made as it is (no reshape
        between), the axis that softmax normalised over and the axis the loss reads the classes along (both counted
        from 0); None elsewhere (torch tells).
    reshaped_from: for a categorical loss whose input is a reshape (view) of a tensor of 3 or more axes, that
        tensor's shape (torch tells).
    zero_weight: the classes the loss weighs 0 (Keras' `class_weight`, the `weight` of torch's cross-entropy),
        where it weighs any at 0.
    validation_only: the classes the validation's labels hold and the training's never do, where the plugin saw
        both whole (Keras: the arrays fit was given, `validation_split`'s part included) and there are any.
    """

    loss: str
    reads: str
    kind: str
    output: str | None = None
    units: int | None = None
    over_one: bool = False
    labels: Labels | None = None
    settings: dict = field(default_factory=dict)
    terms: int | None = None
    bootstrapped: bool | None = None
    input_shape: tuple | None = None
    softmax_axis: int | None = None
    class_axis: int | None = None
    reshaped_from: tuple | None = None
    zero_weight: tuple | None = None
    validation_only: tuple | None = None


@dataclass(frozen=True)
class FirstStep:
    """step: the step seen. losses: a LossUse per loss the step called.
    objectives: how many objectives the step trains in turn, each with a backward pass of its own followed by
    its optimizers' steps (a GAN's discriminator step, then its generator step: 2); None where the plugin cannot
    tell. With more than one, the loss handed to tripwire is one objective among others trained against or beside
    it, and whether it goes down says nothing about the training (`not_a_fit`).
    producers: {activation: the layer whose output it took}, as the plugin saw the step's forward pass where it
    captured activations there (each call of a module called several times under its own name, naming.call_path):
    an activation missing took something else (a sum, a layer's output reshaped); None where not seen.
    column_swaps: (validation column, the training column it is) for the columns of a validation set that are the
    training's in another order (swapped_columns), where the plugin saw both and found any.
    samples_own_output: the step drew random samples from the model's output (a policy's actions, drawn by
    torch.multinomial under Categorical.sample): its loss is a policy-gradient objective, whose value is no
    measure of the fit (`not_a_fit`); None where the plugin cannot tell (torch tells)."""

    step: int
    losses: tuple = ()
    objectives: int | None = None
    producers: dict | None = None
    column_swaps: tuple | None = None
    samples_own_output: bool | None = None

    def to_dict(self) -> dict:
        """As stored: what is not known (an output no plugin could name, labels it did not see) is absent."""
        known = {"objectives": self.objectives, "producers": self.producers,
                 "column_swaps": [list(pair) for pair in self.column_swaps] if self.column_swaps else None,
                 "samples_own_output": self.samples_own_output}
        return {"step": self.step, "losses": [{k: v for k, v in asdict(u).items() if v is not None}
                                              for u in self.losses],
                **{key: value for key, value in known.items() if value is not None}}

    @classmethod
    def from_dict(cls, data) -> FirstStep | None:
        """From its stored form; None for anything that is not one (a foreign or damaged file)."""
        try:
            losses = []
            for entry in data["losses"]:
                labels = entry.get("labels")
                labels = Labels(**{**labels, "shape": tuple(labels["shape"])}) if labels else None
                shapes = {key: tuple(entry[key]) for key in ("input_shape", "reshaped_from", "zero_weight",
                                                             "validation_only") if entry.get(key)}
                losses.append(LossUse(**{**entry, "labels": labels, **shapes}))
            objectives, producers = data.get("objectives"), data.get("producers")
            if producers is not None and not all(isinstance(v, str) for v in dict(producers).values()):
                return None
            swaps = tuple((int(a), int(b)) for a, b in data["column_swaps"]) if data.get("column_swaps") else None
            own = data.get("samples_own_output")
            return cls(int(data["step"]), tuple(losses), None if objectives is None else int(objectives),
                       None if producers is None else {str(k): v for k, v in dict(producers).items()}, swaps,
                       None if own is None else bool(own))
        except (KeyError, TypeError, ValueError):
            return None


def not_a_fit(first: FirstStep | None) -> str | None:
    """Why the training loss is not the one objective the step trains, or not a measure of the fit, where the first
    step says so (a GAN's, a policy gradient's, a DQN's); None otherwise. The rules that judge its course
    (loss_not_decreasing, loss_spike) do not apply then."""
    if first is None:
        return None
    if first.objectives is not None and first.objectives > 1:
        return (f"the step trains {first.objectives} objectives in turn, each with a backward pass and optimizer "
                "steps of its own (a GAN's discriminator and generator): the loss handed over is one of them, "
                "trained against the others, and need not go down")
    if first.samples_own_output:
        return ("the step draws samples from the model's own output (a policy's actions): its loss is a "
                "policy-gradient objective, the log-probabilities of those samples weighted by their returns, whose "
                "value need not go down as the policy improves")
    moving = [use.loss for use in first.losses if use.bootstrapped]
    if moving:
        return (f"the targets of its {moving[0]} are computed by the model itself (a temporal-difference target "
                "from a target network, a momentum encoder's or a teacher's output): they move as it trains, and "
                "the loss's level is no measure of the fit")
    return None


def summed_terms(first: FirstStep | None) -> int | None:
    """The most terms one of the first step's losses adds up (LossUse.terms); None where each takes a mean."""
    counts = [use.terms for use in (first.losses if first is not None else ()) if use.terms]
    return max(counts) if counts else None


def loss_use(loss: str, output: str | None = None, units: int | None = None, over_one: bool = False,
             labels=None, terms: int | None = None, bootstrapped: bool | None = None,
             input_shape: tuple | None = None, softmax_axis: int | None = None, class_axis: int | None = None,
             reshaped_from: tuple | None = None, zero_weight: tuple | None = None,
             validation_only: tuple | None = None, **settings) -> LossUse | None:
    """A LossUse for a loss of a known name (None for another: its reading is not known); `labels` an array."""
    if loss not in READS:
        return None
    reads = "logits" if loss == "binary_cross_entropy" and settings.get("from_logits") else READS[loss]
    if loss in ("cross_entropy", "binary_cross_entropy") and settings.get("from_logits") is False:
        reads = "probabilities"
    return LossUse(loss, reads, KINDS[loss], output if output in ACTIVATIONS else None, units, over_one,
                   Labels.of(labels) if labels is not None else None,
                   {k: v for k, v in settings.items() if isinstance(v, (bool, int, float, str))}, terms, bootstrapped,
                   input_shape, softmax_axis, class_axis, reshaped_from, zero_weight, validation_only)


def task_of(first: FirstStep | None) -> str | None:
    """What the training learns, from its losses: `regression` or `ranking` where every loss is one,
    `classification` where one learns classes; None where the first step does not say (the rules judge the data by
    its shapes)."""
    kinds = {use.kind for use in first.losses} if first is not None else set()
    if kinds & {"categorical", "binary"}:
        return "classification"
    return kinds.pop() if len(kinds) == 1 and kinds <= {"regression", "ranking"} else None


SAME_MEAN = 0.1  # a column's mean within this many of its standard deviations (plus sampling error) of another's
OTHER_MEAN = 1.5  # ... and further than this from the column of its own index
SPREAD = 1.3  # their standard deviations within this factor of each other
COLUMN_ROWS = 2000  # rows of each set compared
MIN_VALUES = 5  # distinct values a column takes to be judged


def swapped_columns(training, validation) -> tuple | None:
    """The validation set's columns that are the training set's in another order: (validation column, training
    column) for each column whose mean and spread match another training column's and not its own, where they
    close into a permutation (3 -> 7 -> 3), which drift of a feature does not. Columns matched by position alone
    (numpy arrays, a DMatrix built from them) are silently wrong when one set's columns were taken in another
    order. Numpy arrays of rows by columns, NaN for missing values; None where there are none (or fewer than 30
    rows, or other data)."""
    if not (isinstance(training, np.ndarray) and isinstance(validation, np.ndarray)) or \
            not all(np.issubdtype(a.dtype, np.number) for a in (training, validation)):
        return None
    sets = [a[:COLUMN_ROWS].astype(np.float64) for a in (training, validation)]
    if any(a.ndim != 2 or a.shape[0] < 30 for a in sets) or sets[0].shape[1] != sets[1].shape[1]:
        return None
    with np.errstate(all="ignore"):
        (mean_t, mean_v), (std_t, std_v) = ([np.nanmean(a, axis=0) for a in sets],
                                            [np.nanstd(a, axis=0) for a in sets])
        varies = std_t > 0
        # how far each validation column's mean (rows) lies from each training column's (columns), in the
        # training column's standard deviations
        apart = np.abs(mean_v[:, None] - mean_t[None, :]) / np.where(varies, std_t, np.inf)[None, :]
        alike = (apart < SAME_MEAN + 3 / np.sqrt(sets[1].shape[0])) & \
            (np.abs(np.log(std_v[:, None] / std_t[None, :])) < np.log(SPREAD))
    # a yes/no or few-valued column (a one-hot code) is like many others, and its share drifts: not judged
    varies &= np.array([len(np.unique(column[np.isfinite(column)])) >= MIN_VALUES for column in sets[0].T])
    alike &= varies[None, :] & varies[:, None]
    moved = np.flatnonzero(varies & (np.diag(apart) > OTHER_MEAN) & np.any(alike, axis=1))
    match = {int(i): int(np.flatnonzero(alike[i])[np.argmin(apart[i][alike[i]])]) for i in moved}
    swaps = []
    for start in match:  # keep the columns whose matches lead back to them
        column, seen = match[start], 1
        while column in match and column != start and seen <= len(match):
            column, seen = match[column], seen + 1
        if column == start:
            swaps.append((start, match[start]))
    return tuple(swaps) or None


def caller_locals(function: str, holding: str) -> dict:
    """The locals of the nearest caller named `function` that holds a local `holding` ({} where none does): what a
    framework's training call was given (its data, its arguments), where it hands its callbacks none of it (Keras'
    fit, xgb.train). Read once, as training begins; not to be kept, as they hold the training data."""
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == function and holding in frame.f_locals):
        frame = frame.f_back
    return frame.f_locals if frame is not None else {}
