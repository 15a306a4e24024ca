"""Where a step's first NaN/Inf began, as the plugin found it (tripwire.plugins.torch.origin and
tripwire.plugins.keras.origin replay the step's forward from the state before its update): the facts they record and the words
exploding_tensor's verdict uses to name the module, what came into it and the change to make."""

from __future__ import annotations

from .base import values_at

ORIGIN = "origin"  # where the plugin found the first NaN/Inf of a step began (tripwire.plugins.torch.origin)
OWN_FORWARD = "forward"  # the path named for the model itself: an operation between its layers
LOSS = "loss"  # the path named where the model's output was finite and the loss made from it is not
GROWN = 1e6  # |values| a model's activations or outputs reach only once training has blown up
GROWN_HINT = ("The values grew until they overflowed: the NaN is where that showed, not its cause. Lower the "
              "learning rate (10x), clip gradients (gradient_clip_val / clip_grad_norm_; Keras: the optimizer's "
              "clipnorm), normalise the inputs, and look at the steps before this one (the weights' and updates' "
              "growth).")


def origin_facts(path: str, output_bad: int, input_bad: int, input_top: float, weight_bad: int) -> dict:
    """{`origin/<path>`: facts} as a plugin records them for the first layer whose output held NaN/Inf: how many
    (`nonfinite_count`); its input's NaN/Inf (`input_nonfinite_count`) or, where there were none, its input's
    largest |value| (`input_max_abs`: an overflow where it is near the dtype's largest); its own parameters'
    NaN/Inf (`weight_nonfinite_count`, where any)."""
    facts = {"nonfinite_count": float(output_bad)}
    if input_bad:
        facts["input_nonfinite_count"] = float(input_bad)
    else:
        facts["input_max_abs"] = float(input_top)
    if weight_bad:
        facts["weight_nonfinite_count"] = float(weight_bad)
    return {f"{ORIGIN}/{path}": facts}


def loss_facts(output_top: float | None) -> dict:
    """{`origin/loss`: facts} for a non-finite loss made from a finite model output (its largest |value|, where it
    could be read)."""
    facts = {"nonfinite_count": 1.0}
    if output_top is not None:
        facts["output_max_abs"] = float(output_top)
    return {f"{ORIGIN}/{LOSS}": facts}


def origin_of(run, step: int) -> tuple[str, str] | None:
    """(what, hint) naming where this step's NaN/Inf began, from the `origin/<module>` facts the plugin recorded
    with it; None where it recorded none (it looks where it can replay the step's forward exactly)."""
    counts = values_at(run, step, "nonfinite_count", [ORIGIN])
    if not counts:
        return None
    name, count = next(iter(counts.items()))
    path = name.split("/", 1)[1]

    def fact(reduction):
        return values_at(run, step, reduction, [ORIGIN]).get(name)

    if path == LOSS:
        top = fact("output_max_abs")
        if top is not None and top >= GROWN:
            return (f"It showed in the loss, computed from a model output that had grown to {top:.3g}: the values "
                    "blew up before the loss overflowed on them.", GROWN_HINT)
        size = f" (largest |value| {top:.3g})" if top is not None else ""
        return (f"It began in the loss: the model's output was finite{size} and the loss computed from it is not.",
                "Look at the loss computation: a log of 0 (log(softmax) or log(sigmoid) of a saturated output), a "
                "division by a sum that can be 0, an exp that overflows. Use the framework's fused loss on logits "
                "(torch's cross_entropy, binary_cross_entropy_with_logits; Keras' losses with from_logits=True), or "
                "add an epsilon (log(p + 1e-8)).")
    layer = f"`{path}`" if path != OWN_FORWARD else "the model's own forward (an operation between its submodules)"
    classes = {p.layer_class for p in run.model.layer_parameters(path)} if run.model is not None else set()
    if len(classes) == 1:
        layer += f" ({classes.pop()})"
    given, weights = fact("input_nonfinite_count"), fact("weight_nonfinite_count")
    if given:
        return (f"The input of {layer} already held {int(given)} NaN/Inf value(s): the batch itself, or an "
                "operation outside the modules before it.",
                f"Check the data of step {step} for NaN/Inf (torch.isfinite(x).all(), np.isfinite(x).all()) and any "
                f"operation on the input before {layer}.")
    if weights:
        return (f"It began in {layer}, whose own parameters hold {int(weights)} NaN/Inf value(s): an earlier "
                "update made them.", GROWN_HINT)
    top = fact("input_max_abs")
    if top is not None and top >= GROWN:
        return (f"It began in {layer}: its output holds {int(count)} NaN/Inf value(s) from a finite input that "
                f"had grown to {top:.3g} (an overflow).", GROWN_HINT)
    size = f" (largest |input| {top:.3g})" if top is not None else ""
    return (f"It began in {layer}: its output holds {int(count)} NaN/Inf value(s) from a finite input{size}.",
            f"Look at {layer}'s computation at step {step}: a log or sqrt of values that reach 0 or below, a "
            "division by ~0, an exp of a large value. Clamp its input or add an epsilon (log(x + 1e-8), "
            "x / (norm + 1e-8)).")
