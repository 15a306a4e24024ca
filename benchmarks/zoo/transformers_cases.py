"""The Hugging Face Transformers cases of the zoo: `transformers.Trainer` with tripwire's callback.

Two healthy setups as users write them, from configs (random initialisation, nothing downloaded), on synthetic
token ids: a BERT-style sequence classifier (is token 5 in the row?) and a GPT-2-style causal language model on
repeating sequences. Each trains with the Trainer's defaults (AdamW, linear decay, gradient clipping at 1) on the
CPU, one thread, fixed seeds, and reaches a target on held-out data. Transformers' `initializer_range` (0.02) is
sized for widths of hundreds; these models are 32 wide, so they scale it to their width, as BERT-base's 0.02 is to
768 (0.02 * sqrt(768 / 32) ~ 0.1): at 0.02 every kernel starts 25x below the variance Glorot gives a 32-wide
layer.

Each faulty case is the classifier with one real bug: AdamW at learning rate 100, an encoder layer frozen by a
freezing loop that reached the wrong index, one-hot labels scaled like pixels (float labels make the model switch
to a multi-label loss), and a batch whose labels are all ignored (-100), whose loss is NaN (0/0), which the
Trainer's own logs hide (`logging_nan_inf_filter`). AdamW at 100 makes no NaN here: Adam's steps are bounded by
the rate and LayerNorm keeps the activations finite, so the weights grow to a variance of 1e4 and the model
saturates.
"""

from __future__ import annotations

import math
import tempfile

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset
from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel, Trainer,
                          TrainingArguments)

from . import data
from .case import SILENT, Case, Outcome

torch.set_num_threads(1)
INIT = 0.1  # initializer_range for 32-wide models (see above)


class Rows(Dataset):
    """Token-id rows and their labels as the Trainer's dict examples."""

    def __init__(self, ids, labels):
        self.ids, self.labels = torch.as_tensor(ids), torch.as_tensor(labels)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Stream(IterableDataset):
    """The rows in their order, once, as a streamed data set (the Trainer does not shuffle a stream)."""

    def __init__(self, ids, labels):
        self.rows = Rows(ids, labels)

    def __iter__(self):
        return (self.rows[i] for i in range(len(self.rows)))


def tiny_bert(**overrides) -> BertForSequenceClassification:
    """A 2-layer, 32-wide BERT sequence classifier over 64 token ids, 2 classes."""
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2, initializer_range=INIT, **overrides))


def tiny_gpt2(vocab: int = 32) -> GPT2LMHeadModel:
    """A 2-layer, 32-wide GPT-2 language model over `vocab` token ids, its output tied to its input embedding."""
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                      bos_token_id=0, eos_token_id=0, initializer_range=INIT))


def arguments(output_dir: str, **overrides) -> TrainingArguments:
    """TrainingArguments of the zoo: batch 32, evaluation every epoch, a log every 10 steps, no checkpoints, no
    reporting integrations, the CPU, seed 0."""
    return TrainingArguments(**{
        "output_dir": output_dir, "per_device_train_batch_size": 32, "per_device_eval_batch_size": 128,
        "learning_rate": 3e-3, "num_train_epochs": 6, "logging_steps": 10, "eval_strategy": "epoch",
        "save_strategy": "no", "report_to": [], "disable_tqdm": True, "use_cpu": True, "seed": 0, **overrides})


def accuracy(prediction) -> dict:
    """compute_metrics of a classifier: the share of rows whose largest logit is the label (the largest entry of a
    one-hot label row)."""
    labels = prediction.label_ids
    labels = labels if labels.ndim == 1 else np.argmax(labels, -1)
    return {"accuracy": float((np.argmax(prediction.predictions, -1) == labels).mean())}


def train(attach, model, train_set, val_set, compute_metrics=None, **overrides) -> tuple[dict, int]:
    """Train with the Trainer, tripwire's callback in `callbacks=[...]` when attached; the last evaluation's metrics
    and the optimizer steps that ran."""
    callbacks = [attach.transformers()] if attach is not None else []
    with tempfile.TemporaryDirectory(prefix="zoo-transformers-") as output_dir:
        trainer = Trainer(model=model, args=arguments(output_dir, **overrides), train_dataset=train_set,
                          eval_dataset=val_set, compute_metrics=compute_metrics, callbacks=callbacks)
        trainer.train()
        return trainer.evaluate(), trainer.state.global_step


def bert_classifier(attach, long: bool, build=tiny_bert, labels=lambda y: y, **overrides) -> Outcome:
    """Healthy: the BERT classifier on token presence, AdamW 3e-3; learned: validation accuracy >= 0.9."""
    (xt, yt), (xv, yv) = data.token_presence(n=(512, 2048)[long])
    metrics, steps = train(attach, build(), Rows(xt, labels(yt)), Rows(xv, labels(yv)), accuracy, **overrides)
    value = metrics.get("eval_accuracy", 0.0)
    return Outcome(value >= 0.9, f"val_accuracy {value:.3f} (>= 0.9)", steps)


def gpt2_lm(attach, long: bool) -> Outcome:
    """Healthy: the GPT-2 language model on sequences repeating a pattern of 4 tokens, AdamW 1e-2; learned: a
    validation loss below half of ln(vocab), chance (the first 3 of 23 next tokens cannot be predicted: at best
    0.45)."""
    (xt, yt), (xv, yv) = data.repeating_sequences()
    metrics, steps = train(attach, tiny_gpt2(), Rows(xt, yt), Rows(xv, yv), learning_rate=1e-2,
                           num_train_epochs=(10, 30)[long])
    value, target = metrics["eval_loss"], math.log(32) / 2
    return Outcome(value <= target, f"val_loss {value:.3f} (<= {target:.3f})", steps)


def lr_100(attach, long):
    """The classifier with AdamW at learning rate 100 (3e-3 is healthy)."""
    return bert_classifier(attach, long, learning_rate=100.0)


def encoder_layer_frozen(attach, long):
    """The classifier with its second encoder layer frozen by a freezing loop that reached the wrong index."""
    def build():
        model = tiny_bert()
        model.bert.encoder.layer[1].requires_grad_(False)
        return model
    return bert_classifier(attach, long, build=build)


def labels_x255(attach, long):
    """The classifier given its labels one-hot as floats divided by 255, like pixels: the model takes float labels
    for a multi-label task (binary cross-entropy per class), whose targets here never reach 0.5."""
    return bert_classifier(attach, long, labels=lambda y: np.eye(2, dtype=np.float32)[y] / 255)


MASKED_STEP = 7


def masked_batch(attach, long):
    """The classifier on a stream whose 8th batch (step 7) has every label -100, the ignore index (a data bug: every
    target of the batch masked or cut off): its loss is 0/0, NaN. Its gradients are zeros, so the weights survive,
    and the Trainer's logs show the mean of the other losses instead."""
    (xt, yt), (xv, yv) = data.token_presence(n=(512, 2048)[long])
    xt, yt = np.tile(xt, (6, 1)), np.tile(yt, 6)  # six epochs of a stream
    yt[MASKED_STEP * 32:(MASKED_STEP + 1) * 32] = -100
    metrics, steps = train(attach, tiny_bert(), Stream(xt, yt), Rows(xv, yv), accuracy, max_steps=len(xt) // 32)
    value = metrics.get("eval_accuracy", 0.0)
    return Outcome(value >= 0.9, f"val_accuracy {value:.3f} (>= 0.9)", steps)


CASES: list[Case] = [
    Case("transformers", "bert_classifier", bert_classifier),
    Case("transformers", "gpt2_lm", gpt2_lm),
    Case("transformers", "bert_lr_100", lr_100, fault="AdamW learning rate 100", catch=("learning_rate",)),
    Case("transformers", "bert_layer_frozen", encoder_layer_frozen, fault="encoder layer 1 frozen by mistake",
         catch=("unchanged_tensor", "untrained_parameters"), tags=SILENT),
    Case("transformers", "bert_labels_x255", labels_x255, fault="one-hot float labels / 255", catch=("loss_setup",)),
    Case("transformers", "bert_masked_batch", masked_batch, fault="a batch with every label -100: NaN loss",
         catch=("exploding_tensor",), onset=MASKED_STEP),
]
