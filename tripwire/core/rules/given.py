"""What loss_setup finds in what the training was given besides its model and loss (tripwire.core.rules.setup): class
weights that leave classes out, a validation of classes training never holds, validation columns in another order
than the training's. The plugins read them from the training call (Keras' fit, xgb.train, torch's loss weights)
and record them with the first step (tripwire.core.firststep)."""

from __future__ import annotations

from ..firststep import OTHER_MEAN


def classes_given(use) -> list:
    """(finding, severity, message) for what the training was given of the classes: weights that leave classes out,
    a validation of others."""
    out = []
    if use.zero_weight and len(use.zero_weight) >= 2:  # one class weighed 0 can be a padding class
        out.append(("classes_weighted_out", "warning", f"the class weights weigh {len(use.zero_weight)} classes "
                    f"at 0 ({_listed(use.zero_weight)}): their samples add nothing to the loss, and the model never "
                    "learns them. Weights computed by integer division (total // (classes * count))? Compute them "
                    "as floats (sklearn's compute_class_weight), and check that every class's weight is above 0."))
    if use.validation_only:
        out.append(("validation_classes_untrained", "warning", f"the validation labels hold "
                    f"{len(use.validation_only)} class(es) that the training labels never do "
                    f"({_listed(use.validation_only)}): the model cannot learn them, and the validation measures "
                    "what training never sees. validation_split takes the last part of the arrays, before any "
                    "shuffling: on data ordered by class, shuffle the arrays before fit (or pass validation_data "
                    "drawn from every class)."))
    return out


def _listed(classes) -> str:
    return ", ".join(str(c) for c in classes[:12]) + (", …" if len(classes) > 12 else "")


def swapped_message(swaps: tuple) -> str:
    """What a verdict says of validation columns that are the training's in another order (FirstStep.column_swaps)."""
    pairs = ", ".join(f"{v} is like {t}" for v, t in swaps[:8])
    return (f"the validation data's columns are the training data's in another order: {len(swaps)} validation columns "
            f"differ from the training column of their index by more than {OTHER_MEAN:g} standard deviations and "
            f"match another's mean and spread (validation column {pairs}{', …' if len(swaps) > 8 else ''}): the "
            "model is judged on features it was not trained on. Build both sets with one column order (select the "
            "columns by name; pandas frames carry names XGBoost checks).")
