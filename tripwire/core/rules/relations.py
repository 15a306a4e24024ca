"""Relations every healthy training step obeys, whose breaking shows no bad number: the loss goes down a little, every
tensor looks fine, and the run is wrong.

The plugins record the facts (collection `relations`, one count per relation and step: how many parameters or
modules broke it, 0 where it held; absent where the framework does not expose it) at the sampled steps and at the
first steps of training, where such a bug first shows; this rule judges them as soon as one breaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Requirement, Rule, values_at
from .relation_kinds import RELATIONS

# Relations broken only past a count: a GradScaler skips the first steps of fp16 training until its scale fits
# (from 2^16, a few halvings); 30 skips in a row have cut the scale by 1e9.
SKIPPED_STEPS = 30
AT_LEAST = {"skipped_steps": SKIPPED_STEPS}


@dataclass
class TrainingRelations(Rule):
    """A relation that every healthy training step obeys, broken: gradients not cleared between optimizer steps
    (a missing `zero_grad()`), training in eval mode and validating in train mode, an optimizer step with no
    gradient to apply or that changes nothing, trained layers cut off from the loss by a detach, every step
    skipped by a loss scaler, a loader that hands out one batch again and again, replicas that drift apart, an
    optimizer that never steps."""

    name = "training_relations"
    modes = ("train",)
    condition = ("at a sampled step (and steps 1 and 2, where these bugs first show) where the plugin recorded the "
                "relation: `stale_gradients` — after an optimizer step, a parameter's gradient arrived at every "
                "backward pass of the next step on top of a `.grad` that was not cleared (error); "
                "`gradients_discarded` — over the first 4 steps, before any optimizer stepped, the gradients of one "
                "step were cleared before the next step's arrived, at two steps in a row: an optimizer.step() that "
                "never runs (error, told at the step it is known; not where the gradients accumulate, nor where they "
                "overflowed, as a GradScaler skips such a step; the probe and Lightning's manual optimisation); "
                "`eval_mode` — an optimizer stepped while the model, as a whole, was in eval mode, with dropout or "
                "batch normalisation in it (warning; the probe tells it at the step it happens, sampled or not); "
                "`train_mode_eval` — metrics logged as an evaluation after forwards with the model in train mode, "
                "dropout or batch normalisation in it (warning; the probe, at the first evaluation); `no_gradients` — "
                "an optimizer stepped while every parameter it holds had a gradient that was None or all zero (error; "
                "not where the step's loss is exactly 0, a minimum with no gradient to give: a hinge loss every "
                "sample clears, a sum of ReLUs all off, nor where that optimizer applied a gradient at another of its "
                "steps in the step: a chunk of the batch it fits exactly); `no_gradient_path` — parameters that ran "
                "in the forward, held by an optimizer that stepped, got no gradient at any backward pass of the step, "
                "and a module whose forward came after theirs received, while gradients were recorded, a float input "
                "that records none and holds an earlier module's output (the same storage: a detached output, or one "
                "computed under torch.no_grad(); warning; a cut whose upstream still gets a gradient by another path, "
                "an unused head with no cut above it, and modules run in eval mode, a part the program holds in "
                "inference (a feature extractor frozen on purpose), break nothing); `step_changed_nothing` — an "
                "optimizer step left unchanged each of its (up to 4) smallest parameters that had a non-zero gradient "
                "and a learning rate above 0, where an update of lr x the largest gradient would have shown in the "
                "dtype of one of them (16 units in the last place of its largest value) (error; a step a GradScaler "
                "skipped is not judged; between samples the probe, Lightning and the Trainer compare each optimizer's "
                "smallest such parameter at every step and tell the second step in a row that left it unchanged where "
                "an update of lr x its largest gradient would have shown in its dtype, so a step that stops updating "
                "mid-run is told within a step; on an accelerator the answer is read a step or a few later, without "
                "waiting, and told with the step it was about; once 4 steps of an optimizer changed that parameter, "
                "each moving torch's version count of it, a step that leaves the count unchanged is taken as one that "
                "changed nothing, and the parameter is compared again from the next step: no copy, no comparison "
                "while the count moves); `update_rounds_away` — the same unchanged parameters where no such update "
                "would have shown: a learning rate too low for the weights' precision (a scheduler stepped per batch "
                "where it was written per epoch; bf16 weights without fp32 master weights; error, at a sampled step); "
                "`repeated_batch` — every tensor of the batch exactly equal to the last batch's at two steps in a "
                "row, where an epoch holds more than one batch (warning; Lightning and the Hugging Face Trainer, at "
                "the first steps and at consecutive steps the plugin sees, on an accelerator at sampled steps only; "
                "the plain-loop probe, over its first 6 steps, where each of those steps' inputs came from an "
                "iterator started for it over a DataLoader of several batches and left after its first: a full-batch "
                "training, from one tensor or a loader of one batch, is not judged; Keras, from digests of the inputs "
                "of steps 0-2 where they reach the host whole (on the CPU), where an epoch holds more than one step "
                "and a call runs one, and not of a batch whose samples are all alike); "
                "`same_eval_data` — an XGBoost eval set logged exactly the metrics of another at every round so far "
                "(warning); `replicas_differ` — under DDP, after an optimizer step, some rank's parameters (a "
                "checksum of their bits) differ from rank 0's (error; the probe and Lightning); `skipped_steps` — no "
                "optimizer stepped at 30 or more steps in a row, the gradients holding Inf or NaN (a GradScaler or "
                "Keras' LossScaleOptimizer that skips every step: error, told at the 30th step in a row; not under "
                "JAX); `schedule_never_stepped` — under Lightning's manual optimisation, a learning-rate scheduler "
                "from configure_optimizers whose step count has not moved since the training started, judged once, "
                "after twice its declared interval of epochs (two epochs for one per step or per epoch) and their "
                "epoch-end hooks, or at the end of a training that ran that long (warning); `dropout_in_eval` — "
                "in the first evaluation forward (the model in eval mode), a dropout applied as a function with "
                "training on and p above 0 (F.dropout's default; warning; the probe and Lightning, watched under a "
                "torch function mode for that forward only); `schedule_interval` — "
                "under Lightning's automatic optimisation, before the first step, a copy of a scheduler stepped over "
                "the planned training at its interval and at the other: stepped per epoch, its rate never gets past "
                "10 % of the peak it reaches stepped per optimizer step (a warmup counted in steps), or stepped per "
                "optimizer step, its rate is at most 1 % of its base from a tenth into the training on (no restart) "
                "where per epoch it would be 10 % or more there (a decay counted in epochs); not for trainings of "
                "fewer than 3 epochs, nor a "
                "ReduceLROnPlateau (warning); `rate_collapsed` — in the probe, an optimizer's learning rate (the "
                "largest of its groups', read at every 8th step) at 1 % of its peak so far or below, without a break, "
                "for as many steps as it took to get there and at least 10, a scheduler that holds the optimizer "
                "having stepped at every training step: a schedule that ends at 0 stops the training there, a cosine "
                "rises again, a step decay's last stage is shorter than the ones before it (warning, looked at once; "
                "a rate lowered per epoch, by the loop itself or by a ReduceLROnPlateau is not judged); "
                "`trainable_after_compile` and `frozen_after_compile` — at a Keras fit's first step on TensorFlow, "
                "variables whose layer's `trainable` changed after the model's train function first applied "
                "gradients (told by the variables its optimizer was built for), which that function, reused until "
                "compile(), leaves untrained or trains all the same (error; that fit runs Keras' own function "
                "alone). PyTorch: the probe, Lightning and the Hugging Face Trainer; `stale_gradients` can break "
                "only where the user clears gradients (the probe, Lightning's manual optimisation). Keras applies its "
                "gradients itself: of these it can break `skipped_steps`, `repeated_batch` and the two of `trainable` "
                "only")
    hint = ("A relation every healthy training obeys was broken; the message names it and the change to make.")
    source = ("TrainCheck (Lu et al., OSDI 2025) infers such invariants from healthy runs and catches silent errors "
              "within an iteration; here the relations are known in advance and judged from facts the plugin "
              "records at no per-step cost, so a healthy run has nothing to break.")

    def requires(self):
        # the first batches' inputs, where a plugin judges from them whether the batch changes (Keras)
        return [Requirement("relations", steps=(1, 2)), Requirement("inputs", steps=(0, 1, 2), optional=True)]

    def check(self, run, step):
        found = []
        for name, count in values_at(run, step, "value", ["relations"]).items():
            relation = name.split("/", 1)[1]
            if relation not in RELATIONS or count < AT_LEAST.get(relation, 1):
                continue
            if relation == "no_gradients" and _loss_at(run, step) == 0:  # at its minimum: nothing to learn from
                continue
            severity, what, hint = RELATIONS[relation]
            found.append(self.fire(step, f"step {step}: {what.format(n=int(count))}.", severity=severity,
                                   finding=relation, hint=hint, count=int(count)))
        return found or None


def _loss_at(run, step: int) -> float | None:
    """The training loss recorded at this step, where it was."""
    if "losses/train" not in run.tensor_names("losses"):
        return None
    try:
        return float(run.tensor("losses/train").reduction(step))
    except LookupError:
        return None
