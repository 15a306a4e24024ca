"""One diagnosis per root cause: the verdicts that follow from one fault, grouped under the verdict that explains them.

A fault shows as several verdicts. Dead ReLUs leave their layers' gradients at zero, their weights unchanged and
the loss flat; a learning rate too high gives huge update ratios, weights whose variance jumps, then NaN. The links
between them (CAUSES, documented in docs/rules.md) are causal facts about training: a verdict of one kind can
explain verdicts of the kinds listed for it that began no earlier than it did.

Verdicts are taken in the order their findings began (`Verdict.began`; at the same step the kind listed first in
CAUSES, the more fundamental, goes first). A verdict that one taken before it can explain joins that one's
diagnosis; any other begins a diagnosis of its own, as its primary cause. The verdicts stay as they are
underneath (`run.verdicts()`): a diagnosis is read from them, the same way in the training process, in `tripwire
check` and `show`, in the report and in the demo.
"""

from __future__ import annotations

from dataclasses import dataclass

from .verdict import SEVERITIES, Verdict

# The effects of a learning rate too high (or of the huge steps it takes): weights that jump, then overflow; units
# pushed dead or into saturation; a loss that goes nowhere.
_BLOWUP = ("weight_update_ratio:large", "exploding_gradient", "tensor_variance", "exploding_tensor", "dead_relu",
           "saturated_activation", "all_zero", "unchanged_tensor", "vanishing_gradient", "weight_update_ratio",
           "poor_weight_initialization", "loss_not_decreasing", "oscillating_loss", "overfit", "class_imbalance",
           "confusion", "overtraining")
# What follows from layers that pass no gradient back (dead, saturated, vanishing): nothing upstream moves.
_NO_GRADIENT = ("dead_relu", "all_zero", "vanishing_gradient", "weight_update_ratio:small", "unchanged_tensor",
                "loss_not_decreasing", "overfit", "class_imbalance", "confusion", "overtraining")
# What follows from steps that change nothing (a learning rate of 0, frozen parameters).
_NO_STEP = ("weight_update_ratio:small", "unchanged_tensor", "loss_not_decreasing", "overfit", "class_imbalance",
            "confusion", "overtraining")
# What follows from a loss that computes the wrong thing (the output read as another kind, labels that are not
# class ids): the model learns slowly or not at all.
_WRONG_LOSS = ("loss_not_decreasing", "vanishing_gradient", "weight_update_ratio:small", "unchanged_tensor",
               "all_zero", "tensor_variance", "dead_relu", "saturated_activation", "overfit", "oscillating_loss",
               "class_imbalance", "confusion", "output_loss_mismatch", "overtraining")


@dataclass(frozen=True)
class Cause:
    title: str  # what went wrong, as a user would say it
    explains: tuple = ()  # the kinds of verdict it can explain (a rule, or rule:side)


# Ordered from the most fundamental cause to the plainest symptom: at the same step, the first listed leads (a loss
# that cannot fit its labels before raw inputs, raw inputs before the learning rate: their huge activations make
# any rate's steps look too large).
CAUSES: dict[str, Cause] = {
    "training_relations:stale_gradients": Cause("gradients never cleared (zero_grad missing)",
                                                _BLOWUP + ("learning_rate:high",)),
    "training_relations:no_gradients": Cause("optimizer steps with no gradient (zero_grad between backward and "
                                             "step?)", _NO_STEP + ("all_zero", "vanishing_gradient")),
    "training_relations:step_changed_nothing": Cause("optimizer steps that change nothing", _NO_STEP),
    "training_relations:update_rounds_away": Cause("a learning rate too low for the weights' precision (a "
                                                   "scheduler stepped per batch?)", _NO_STEP),
    "training_relations:gradients_discarded": Cause("optimizer.step() never called", _NO_STEP),
    "training_relations:no_gradient_path": Cause("layers cut off from the loss (a detach)", _NO_STEP),
    "training_relations:schedule_never_stepped": Cause("a learning-rate schedule never stepped (manual "
                                                       "optimisation)", ("loss_not_decreasing", "oscillating_loss",
                                                                         "overtraining")),
    "training_relations:same_eval_data": Cause("the training data used as validation data", ("overfit",
                                                                                             "overtraining")),
    "first_evaluation": Cause("a model evaluated differently from how it trains", ("overfit", "overtraining",
                                                                                   "loss_not_decreasing")),
    "training_relations:eval_mode": Cause("training in eval mode", ("loss_not_decreasing", "overfit",
                                                                    "oscillating_loss")),
    "training_relations:replicas_differ": Cause("DDP replicas that drifted apart (each rank trains alone on its "
                                                "share of the data)", ("overfit", "overtraining", "oscillating_loss")),
    # a loss that cannot learn what it is given (a softmax over one unit, a bounded output short of its targets)
    # is wrong whatever the inputs and the rate: it leads them
    "loss_setup": Cause("output layer, loss and labels do not fit", _WRONG_LOSS + ("exploding_tensor",)),
    "input_not_normalized": Cause("inputs not normalised", _BLOWUP + ("learning_rate:high",)),
    "input_features:scales": Cause("features on scales far apart", _BLOWUP + ("learning_rate:high",
                                                                             "input_not_normalized")),
    "learning_rate:high": Cause("learning rate too high", _BLOWUP),
    "learning_rate:zero": Cause("learning rate 0", _NO_STEP),
    "learning_rate:low": Cause("learning rate too low", _NO_STEP),
    "output_loss_mismatch": Cause("output layer and loss do not fit", _WRONG_LOSS),
    "class_imbalance:not_class_ids": Cause("labels that are not class ids", _WRONG_LOSS),
    "confusion:not_class_ids": Cause("labels that are not class ids", _WRONG_LOSS),
    "overfit:chance": Cause("labels that do not match the inputs", ("overfit", "loss_not_decreasing", "overtraining",
                                                                    "oscillating_loss", "class_imbalance", "confusion",
                                                                    "dead_relu")),
    "loss_not_decreasing:stuck": Cause("labels that do not match the inputs? (the weights move, the loss does "
                                       "not)", ("overfit", "overtraining", "oscillating_loss", "class_imbalance",
                                                "confusion", "dead_relu")),
    "poor_weight_initialization": Cause("poor weight initialisation", _BLOWUP),
    "weight_update_ratio:large": Cause("steps larger than the weights", _BLOWUP),
    "exploding_gradient": Cause("exploding gradients", _BLOWUP),
    "tensor_variance:above": Cause("weights growing without bound", _BLOWUP),
    "untrained_parameters:nothing_trains": Cause("every parameter frozen", _NO_STEP + ("loss_not_decreasing",)),
    "untrained_parameters:no_optimizer": Cause("parameters that no optimizer holds",
                                               _NO_STEP + ("untrained_parameters:frozen",)),
    "unchanged_tensor:lr0": Cause("learning rate 0", _NO_STEP),
    "unchanged_tensor:frozen": Cause("layers frozen by mistake", ("unchanged_tensor", "weight_update_ratio:small",
                                                                  "untrained_parameters:frozen")),
    "untrained_parameters:frozen": Cause("frozen layers", ("unchanged_tensor", "weight_update_ratio:small")),
    "dead_relu": Cause("dead ReLU units", _NO_GRADIENT),
    "saturated_activation": Cause("saturated activations", _NO_GRADIENT),
    "vanishing_gradient": Cause("vanishing gradients", _NO_GRADIENT),
    "exploding_tensor": Cause("NaN/Inf in training", _BLOWUP),
    "all_zero": Cause("all-zero weights or gradients", _NO_GRADIENT + ("tensor_variance:below",)),
    "tensor_variance:below": Cause("collapsed weights", _NO_GRADIENT),
    "weight_update_ratio:small": Cause("steps that do not move the weights", _NO_STEP),
    "unchanged_tensor": Cause("layers that do not train", _NO_STEP),
    "feature_importance_overweight": Cause("one feature carries the model (a leak?)", ("overfit",)),
    "loss_spike": Cause("a loss spike", ("loss_not_decreasing",)),
    "gradient_spike": Cause("a gradient spike", ("loss_spike", "loss_not_decreasing")),
    "overfit": Cause("overfitting", ("overtraining", "oscillating_loss")),
    "oscillating_loss": Cause("oscillating validation loss", ("overfit",)),
    "loss_not_decreasing:slow": Cause("a slow start (the loss has not gone down yet; the weights drift one way)"),
    "loss_not_decreasing": Cause("the loss does not go down", ("overtraining", "class_imbalance", "confusion")),
    "class_imbalance": Cause("class imbalance", ("confusion",)),
    "confusion": Cause("classes confused", ()),
    # each learned invariant a run breaks says the same: it is not like the healthy runs they were learned from
    "learned_invariants": Cause("a departure from what healthy runs of this pipeline held", ("learned_invariants",)),
}
_RANK = {kind: i for i, kind in enumerate(CAUSES)}


def kind(verdict: Verdict) -> str:
    """What a verdict says, for the causal links: its rule, with the side of its finding where the rule has two
    findings of different meaning (`weight_update_ratio:large` and `:small`)."""
    rule, finding = verdict.rule, verdict.finding
    if rule in ("tensor_variance", "weight_update_ratio", "learning_rate", "input_features", "training_relations"):
        return f"{rule}:{finding.rsplit(':', 1)[-1]}"
    if rule == "unchanged_tensor" and finding in ("frozen", "lr0") or rule == "untrained_parameters":
        return f"{rule}:{finding}"
    if rule in ("class_imbalance", "confusion") and finding == "not_class_ids" or \
            rule == "overfit" and finding == "chance" or rule == "loss_not_decreasing" and finding in ("stuck", "slow"):
        return f"{rule}:{finding}"
    return rule


def _matches(symptom: str, listed: str) -> bool:
    return symptom == listed or symptom.startswith(listed + ":")


def explains(cause: Verdict, symptom: Verdict) -> bool:
    """Whether `cause` can explain `symptom`: a documented link between their kinds, and the cause began first
    (or at the same step, ranked as more fundamental), on the same worker."""
    link = CAUSES.get(kind(cause))
    if link is None or cause.worker != symptom.worker:
        return False
    if not any(_matches(kind(symptom), listed) for listed in link.explains):
        return False
    return _order(cause) <= _order(symptom)


def _order(verdict: Verdict) -> tuple:
    return verdict.began, _RANK.get(kind(verdict), len(_RANK)), verdict.step


@dataclass(frozen=True)
class Diagnosis:
    """A root cause: the verdict that explains the others (`primary`), and those it explains (`symptoms`)."""

    primary: Verdict
    symptoms: tuple = ()

    @property
    def cause(self) -> str:
        """The cause in words: what the primary verdict's kind stands for; a rule of the user's (`module:Class`)
        by its class."""
        found = CAUSES.get(kind(self.primary))
        if found is not None:
            return found.title
        rule = self.primary.rule
        return rule.rsplit(":", 1)[1] if ":" in rule else rule.replace("_", " ")

    @property
    def verdicts(self) -> tuple:
        return (self.primary, *self.symptoms)

    @property
    def severity(self) -> str:
        """The worst severity among its verdicts."""
        return min((v.severity for v in self.verdicts), key=SEVERITIES.index)

    @property
    def counts(self) -> bool:
        """Whether any of its verdicts is a warning or an error (what `tripwire check` exits 1 on)."""
        return any(v.counts for v in self.verdicts)

    @property
    def began(self) -> int:
        return self.primary.began

    def describe(self, number: int | None = None, with_hint: bool = True) -> str:
        """The diagnosis as the lines a user reads: the cause and where it began, its evidence, the fix, and the
        symptoms it explains."""
        p = self.primary
        label = "diagnosis" + (f" {number}" if number is not None else "")
        lines = [f"{label} ({self.severity}): {self.cause}, from step {self.began} ({p.mode}, worker {p.worker})",
                 f"    {p.rule} at step {p.step}: {p.message}"]
        if with_hint and p.hint:
            lines.append("    fix: " + p.hint.strip().replace("\n", "\n         "))
        if self.symptoms:
            lines.append(f"    explains {len(self.symptoms)} more verdict(s): " + ", ".join(_symptoms(self.symptoms)))
        return "\n".join(lines)


def _symptoms(symptoms) -> list[str]:
    """Each rule once, at its first step, with how many verdicts it gave."""
    first: dict[str, list] = {}
    for v in symptoms:
        first.setdefault(v.rule, []).append(v)
    return [f"{rule} at step {vs[0].step}" + (f" (x{len(vs)})" if len(vs) > 1 else "") for rule, vs in first.items()]


def diagnose(verdicts) -> list[Diagnosis]:
    """The fired verdicts grouped by root cause, in the order the causes began. Verdicts that are not fired
    (no_data, a rule that failed) are no diagnosis: they say what could not be judged."""
    fired = sorted((v for v in verdicts if v.fired), key=_order)
    groups: list[list[Verdict]] = []
    for verdict in fired:
        home = next((g for g in groups if any(explains(member, verdict) for member in g)), None)
        if home is None:
            groups.append([verdict])
        else:
            home.append(verdict)
    return [Diagnosis(group[0], tuple(group[1:])) for group in groups]


def explained_by(verdict: Verdict, earlier) -> Verdict | None:
    """The primary cause of the diagnosis an arriving verdict joins, among the verdicts found before it (the
    training process's log names it instead of repeating a hint); None where the verdict begins a diagnosis."""
    for found in diagnose([*earlier, verdict]):
        if any(v is verdict for v in found.symptoms):
            return found.primary
    return None


def summary(verdicts, with_hint: bool = True) -> str:
    """What `check`, `show`, the demo and the end of a training print: one block per diagnosis of a warning or an
    error, a line per diagnosis worth a look (info), a line per rule that could not judge; or that nothing fired."""
    diagnoses = diagnose(verdicts)
    counted = [d for d in diagnoses if d.counts]
    lines = [d.describe(i, with_hint) for i, d in enumerate(counted, 1)]
    lines += [f"worth a look (info): {d.cause}: {d.primary.rule} at step {d.primary.step}: {d.primary.message}"
              for d in diagnoses if not d.counts]
    lines += [v.describe(with_hint=False) for v in verdicts if not v.fired]
    if not diagnoses:
        lines.insert(0, "no rule fired.")
    return "\n".join(lines)
