"""Keras 3 zoo cases: realistic `model.fit` setups, healthy or with one real fault, with tripwire as a fit callback.

The module runs on the backend KERAS_BACKEND names when the process starts
(TensorFlow, torch or JAX). Every case starts from a fresh Keras session with
fixed seeds, trains with `verbose=0`, and passes `attach.keras()` in
`model.fit(callbacks=[...])` when the harness attaches tripwire. `backends`
names the backends the test suite runs a case on; MobileNetV2 compiles too
slowly for the short runs and names none (only `make zoo` runs it).
"""

from __future__ import annotations

import keras
import numpy as np
from keras import layers, ops

from . import data
from .case import SILENT, Case, Outcome

ALL_BACKENDS = ("tensorflow", "torch", "jax")


def limit_threads() -> None:
    """One thread for the backend's kernels, as the tests do: the test machines have few cores, shared."""
    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)
    elif keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(1)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:  # TensorFlow already started in this process
            pass


limit_threads()


# -- shared steps -------------------------------------------------------------------------------------------------

def start(seed: int = 0) -> None:
    """A fresh Keras session with fixed seeds: every case begins here."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)


def callbacks(attach) -> list:
    """tripwire's callback, as a user passes it to `model.fit(callbacks=...)`; none without tripwire."""
    return [attach.keras()] if attach is not None else []


def steps(model) -> int:
    return int(model.optimizer.iterations)


def accuracy(model, x, y) -> float:
    """Held-out accuracy of a model whose (first) output holds one score per class."""
    return float(np.mean(np.argmax(predict(model, x), axis=-1) == y))


def predict(model, x):
    """The model's outputs on held-out data, as numpy (a direct call: `predict` would retrace on TensorFlow)."""
    return keras.tree.map_structure(ops.convert_to_numpy, model(x, training=False))


def judged(model, name: str, value: float, target: float) -> Outcome:
    return Outcome(value >= target, f"{name} {value:.2f} (>= {target:.2f})", steps(model))


def compile_classifier(model, optimizer, from_logits: bool = True) -> None:
    """Integer class labels against logits: the usual Keras classifier."""
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits),
                  metrics=["accuracy"])


def fit_classifier(model, train, val, attach, epochs: int, target: float, batch_size: int = 32) -> Outcome:
    """Fit with per-epoch validation; the validation accuracy against `target`."""
    (x, y), (xv, yv) = train, val
    model.fit(x, y, batch_size=batch_size, epochs=epochs, validation_data=(xv, yv), verbose=0,
              callbacks=callbacks(attach))
    return judged(model, "val_acc", accuracy(model, xv, yv), target)


# -- MLP on the digits' 64 features ---------------------------------------------------------------------------------

MLP_LR = 0.05


def mlp(bias_initializer="zeros") -> keras.Model:
    """Two Dense ReLU layers on the 64 digit features and a Dense output of 10 logits."""
    return keras.Sequential([
        keras.Input((64,)),
        layers.Dense(64, activation="relu", bias_initializer=bias_initializer),
        layers.Dense(32, activation="relu", bias_initializer=bias_initializer),
        layers.Dense(10),
    ])


def fit_digits(model, attach, long: bool, lr: float = MLP_LR, digits=None, from_logits: bool = True,
               epochs: int = 5) -> Outcome:
    """SGD with momentum on the standardised digits (or the `digits` given), batches of 32, for `epochs` (40 in
    the long run)."""
    compile_classifier(model, keras.optimizers.SGD(lr, momentum=0.9), from_logits)
    train, val = digits or data.digits()
    return fit_classifier(model, train, val, attach, epochs=40 if long else epochs, target=0.9)


def digits_mlp(attach, long):
    """An MLP on the digits' 64 standardised features, SGD with momentum."""
    start()
    return fit_digits(mlp(), attach, long)


def mlp_lr_x1000(attach, long):
    """The digits MLP with a learning rate 1000x too high (50 instead of 0.05): the loss blows up within a few steps,
    then the ReLUs die (on JAX it reaches NaN)."""
    start()
    return fit_digits(mlp(), attach, long, lr=MLP_LR * 1000)


def dead_relu_bias(attach, long):
    """The digits MLP with its ReLU layers' biases initialised to -20 (a wrong initializer): every unit is dead."""
    start()
    return fit_digits(mlp(bias_initializer=keras.initializers.Constant(-20.0)), attach, long)


def frozen_by_mistake(attach, long):
    """The digits MLP with its middle Dense layer set `trainable=False` by mistake (meant for another layer)."""
    start()
    model = mlp()
    model.layers[1].trainable = False
    return fit_digits(model, attach, long)


def model_frozen(attach, long):
    """The digits MLP with `model.trainable = False` (meant for a base model) before compile: no weight trains;
    Keras fits it all the same, with one warning line."""
    start()
    model = mlp()
    model.trainable = False
    return fit_digits(model, attach, long)


def missing_from_logits(attach, long):
    """The digits MLP, whose output layer gives logits, compiled with the loss's default `from_logits=False`: the
    loss takes the logits for probabilities (a wrong loss for the output)."""
    start()
    return fit_digits(mlp(), attach, long, from_logits=False)


def one_unit_softmax(attach, long):
    """Is it a 0? One output unit with a softmax (always 1) under binary cross-entropy: nothing can learn."""
    start()
    model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"),
                              layers.Dense(1, activation="softmax")])
    model.compile(optimizer=keras.optimizers.SGD(MLP_LR, momentum=0.9), loss="binary_crossentropy")
    (xt, yt), (xv, yv) = data.digits()
    model.fit(xt, (yt == 0).astype("float32"), batch_size=32, epochs=20 if long else 3, verbose=0,
              validation_data=(xv, (yv == 0).astype("float32")), callbacks=callbacks(attach))
    return judged(model, "val_acc", float(np.mean((predict(model, xv)[:, 0] > 0.5) == (yv == 0))), 0.95)


def inputs_x255(attach, long):
    """The digits MLP fed raw 8-bit pixel values (0-255): the inputs were never normalised."""
    start()
    (xt, yt), (xv, yv) = data.digits(standardise=False)
    to_bytes = 255.0 / 16.0  # sklearn's digits are 4-bit intensities (0-16)
    return fit_digits(mlp(), attach, long, digits=((xt * to_bytes, yt), (xv * to_bytes, yv)))


def shuffled_labels(attach, long):
    """The digits MLP trained on labels shuffled apart from their inputs (x and y shuffled separately). The model
    can only memorise: its validation loss climbs once it does, which takes more epochs than the healthy twin's."""
    start()
    (xt, yt), val = data.digits()
    shuffled = np.random.default_rng(0).permutation(yt)
    return fit_digits(mlp(), attach, long, digits=((xt, shuffled), val), epochs=12)


# -- CNNs on the digit images ---------------------------------------------------------------------------------------

def bn_dropout_cnn() -> keras.Model:
    """A Sequential CNN on 8x8 digit images: two Conv-BatchNorm-ReLU-MaxPool stages, Dropout, a Dense head."""
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.MaxPooling2D(),
        layers.Conv2D(32, 3, padding="same", use_bias=False), layers.BatchNormalization(), layers.ReLU(),
        layers.MaxPooling2D(),
        layers.Flatten(), layers.Dropout(0.3),
        layers.Dense(64, activation="relu"), layers.Dropout(0.3),
        layers.Dense(10),
    ])


def fit_images(model, attach, long: bool, train_labels=None) -> Outcome:
    """Adam on the 8x8 digit images (with `train_labels` in place of the training labels, if given)."""
    compile_classifier(model, keras.optimizers.Adam(3e-3))
    (xt, yt), val = data.digit_images(channels_last=True)
    train = (xt, yt if train_labels is None else train_labels(yt))
    return fit_classifier(model, train, val, attach, epochs=30 if long else 6, target=0.9)


def bn_dropout_cnn_case(attach, long):
    """A Sequential CNN with BatchNormalization and Dropout on the digit images, Adam."""
    start()
    return fit_images(bn_dropout_cnn(), attach, long)


def labels_not_class_ids(attach, long):
    """The CNN trained on labels divided by 255 with its images (one normalisation applied to the whole batch):
    sparse categorical crossentropy silently casts the float labels to class 0."""
    start()
    return fit_images(bn_dropout_cnn(), attach, long, train_labels=lambda y: (y / 255.0).astype(np.float32))


def mixed_precision(attach, long):
    """The CNN trained under the mixed_float16 policy (float16 compute, float32 variables, loss scaling); every
    backend computes float16 on the CPU."""
    start()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return fit_images(bn_dropout_cnn(), attach, long)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def spread_out(epsilon: float):
    """Cross-entropy with a small hinge that keeps logits apart: the batch's pairwise distances below 1, as the
    sqrt of the squared differences. The pairs include each sample with itself, whose distance 0 has a sqrt with a
    NaN gradient, unless `epsilon` is added inside."""
    def loss(y, logits):
        logits = keras.ops.cast(logits, "float32")
        distances = keras.ops.sqrt(keras.ops.sum((logits[:, None] - logits[None]) ** 2, -1) + epsilon)
        return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True) + \
            1e-3 * keras.ops.mean(keras.ops.relu(1 - distances))
    return loss


def mixed_precision_spread(attach, long, epsilon: float = 1e-6):
    """The digits MLP under mixed_float16 (compile wraps its optimizer in a LossScaleOptimizer) with the
    spread-out loss."""
    start()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp()
        model.compile(optimizer=keras.optimizers.SGD(MLP_LR, momentum=0.9), loss=spread_out(epsilon),
                      metrics=["accuracy"])
        train, val = data.digits()
        return fit_classifier(model, train, val, attach, epochs=40 if long else 5, target=0.9)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def loss_scale_skips_every_step(attach, long):
    """The spread-out loss without its epsilon: every gradient is NaN, so the LossScaleOptimizer skips every step
    (and halves its scale); the loss stays finite and the model never trains."""
    return mixed_precision_spread(attach, long, epsilon=0.0)


def residual_block(x, filters: int, stride: int = 1):
    """Two 3x3 Conv-BatchNorm layers and a shortcut (a 1x1 projection where the shape changes), then ReLU."""
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.BatchNormalization()(layers.Conv2D(filters, 3, padding="same", use_bias=False)(y))
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = layers.BatchNormalization()(layers.Conv2D(filters, 1, strides=stride, use_bias=False)(x))
    return layers.ReLU()(layers.Add()([y, shortcut]))


def resnet_small(attach, long):
    """A small ResNet (functional API: a stem, an identity block, a strided block with a projection shortcut,
    global average pooling) on the digit images, Adam."""
    start()
    inputs = keras.Input((8, 8, 1))
    x = layers.ReLU()(layers.BatchNormalization()(layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)))
    x = residual_block(residual_block(x, 16), 32, stride=2)
    outputs = layers.Dense(10)(layers.GlobalAveragePooling2D()(x))
    return fit_images(keras.Model(inputs, outputs), attach, long)


def mobilenetv2(attach, long):
    """Keras' MobileNetV2 (alpha 0.35, from scratch) on the digits upsampled to 32x32, Adam.

    Its BatchNormalization keeps moving averages with momentum 0.999, made for ImageNet-length runs: after a few
    hundred steps they still hold their initial values and validation sees chance. As users training it from
    scratch on a small data set do, the momentum is set to 0.9."""
    start()
    model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 1), alpha=0.35, classes=10,
                                           classifier_activation=None)
    for layer in model.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.momentum = 0.9
    compile_classifier(model, keras.optimizers.Adam(3e-3))
    train, val = data.digit_images(size=32, channels_last=True)
    return fit_classifier(model, train, val, attach, epochs=8 if long else 4, target=0.8, batch_size=64)


def transfer_frozen_base(attach, long):
    """Transfer learning as the Keras guide does it: a conv base trained on digits 0-4, frozen
    (`trainable = False`, called with `training=False`), a new head trained on digits 5-9."""
    start()
    (xt, yt), (xv, yv) = data.digit_images(channels_last=True)
    base = keras.Sequential([
        keras.Input((8, 8, 1)),
        layers.Conv2D(16, 3, padding="same", activation="relu"), layers.MaxPooling2D(),
        layers.Conv2D(32, 3, padding="same", activation="relu"), layers.Flatten(),
    ])
    first, second = yt < 5, yt >= 5
    pretrained = keras.Sequential([base, layers.Dense(5)])
    compile_classifier(pretrained, keras.optimizers.Adam(3e-3))
    pretrained.fit(xt[first], yt[first], batch_size=32, epochs=5, verbose=0)

    base.trainable = False
    inputs = keras.Input((8, 8, 1))
    model = keras.Model(inputs, layers.Dense(5)(base(inputs, training=False)))
    compile_classifier(model, keras.optimizers.Adam(3e-3))
    val = (xv[yv >= 5], yv[yv >= 5] - 5)
    return fit_classifier(model, (xt[second], yt[second] - 5), val, attach, epochs=20 if long else 4, target=0.9)


def multi_output(attach, long):
    """A functional CNN with two outputs: the digit (sparse categorical crossentropy) and the image's ink, its mean
    pixel value (mean squared error); one loss per output."""
    start()
    (xt, yt), (xv, yv) = data.digit_images(channels_last=True)
    train_ink = xt.mean(axis=(1, 2, 3))

    def ink(x):
        """The images' mean pixel values, standardised over the training set."""
        return (x.mean(axis=(1, 2, 3)) - train_ink.mean()) / train_ink.std()

    inputs = keras.Input((8, 8, 1))
    x = layers.Conv2D(16, 3, padding="same", activation="relu")(inputs)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(32, 3, padding="same", activation="relu")(x)
    x = layers.Dense(64, activation="relu")(layers.Flatten()(x))
    model = keras.Model(inputs, {"digit": layers.Dense(10, name="digit")(x), "ink": layers.Dense(1, name="ink")(x)})
    model.compile(optimizer=keras.optimizers.Adam(3e-3),
                  loss={"digit": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "ink": "mse"},
                  metrics={"digit": ["accuracy"]})
    model.fit(xt, {"digit": yt, "ink": ink(xt)}, batch_size=32, epochs=25 if long else 5, verbose=0,
              validation_data=(xv, {"digit": yv, "ink": ink(xv)}), callbacks=callbacks(attach))
    predicted = predict(model, xv)
    acc = float(np.mean(np.argmax(predicted["digit"], axis=-1) == yv))
    r2 = 1.0 - float(np.mean((predicted["ink"][:, 0] - ink(xv)) ** 2) / np.var(ink(xv)))
    return Outcome(acc >= 0.9 and r2 >= 0.7, f"val_acc {acc:.2f} (>= 0.90), ink R^2 {r2:.2f} (>= 0.70)", steps(model))


# -- imbalanced binary task -----------------------------------------------------------------------------------------

def class_and_sample_weights(attach, long):
    """"Is this digit a 0?" (10 % positives) on an MLP: a first fit with `class_weight=`, a second one that goes on
    with the same balance given per sample (`sample_weight=`), one callback over both."""
    from sklearn.metrics import balanced_accuracy_score
    from sklearn.utils.class_weight import compute_class_weight, compute_sample_weight

    start()
    (xt, yt), (xv, yv) = data.digits()
    yt, yv = (yt == 0).astype(np.float32), (yv == 0).astype(np.float32)
    model = keras.Sequential([keras.Input((64,)), layers.Dense(32, activation="relu"), layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.BinaryCrossentropy(from_logits=True))
    fit_callbacks = callbacks(attach)  # one callback over both fits: the run goes on from the first
    epochs = 15 if long else 3
    class_weight = dict(enumerate(compute_class_weight("balanced", classes=np.array([0.0, 1.0]), y=yt)))
    model.fit(xt, yt, batch_size=32, epochs=epochs, validation_data=(xv, yv), verbose=0, callbacks=fit_callbacks,
              class_weight=class_weight)
    model.fit(xt, yt, batch_size=32, epochs=epochs, validation_data=(xv, yv), verbose=0, callbacks=fit_callbacks,
              sample_weight=compute_sample_weight("balanced", yt))
    predicted = (predict(model, xv)[:, 0] > 0).astype(np.float32)
    return judged(model, "val_balanced_acc", balanced_accuracy_score(yv, predicted), 0.9)


# -- sequence models on the marker-token task -----------------------------------------------------------------------

VOCAB, LENGTH, CLASSES = 64, 16, 4


def embedding_lstm(attach, long):
    """A text classifier: Embedding with `mask_zero=True` (padded sequences) into an LSTM, Adam."""
    start()
    model = keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        layers.Embedding(VOCAB, 32, mask_zero=True),
        layers.LSTM(32),
        layers.Dense(CLASSES),
    ])
    compile_classifier(model, keras.optimizers.Adam(3e-3))
    train, val = data.token_classes(length=LENGTH, vocab=VOCAB, classes=CLASSES)
    return fit_classifier(model, train, val, attach, epochs=20 if long else 4, target=0.9)


class TokenAndPositionEmbedding(layers.Layer):
    """A learned token embedding plus a learned position embedding (as in the Keras text-transformer example)."""

    def __init__(self, length: int, vocab: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.tokens = layers.Embedding(vocab, width)
        self.positions = layers.Embedding(length, width)

    def call(self, x):
        return self.tokens(x) + self.positions(ops.arange(ops.shape(x)[-1]))


class WarmupLinearDecay(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate that rises linearly from 0 to `peak` over `warmup_steps`, then falls linearly to 0 at
    `total_steps`: peak * min(step / warmup_steps, (total_steps - step) / total_steps)."""

    def __init__(self, peak: float, warmup_steps: int, total_steps: int):
        self.peak, self.warmup_steps, self.total_steps = peak, warmup_steps, total_steps

    def __call__(self, step):
        return self.peak * self.fraction(ops.cast(step, "float32"))

    def fraction(self, step):
        return ops.minimum(step / self.warmup_steps, (self.total_steps - step) / self.total_steps)

    def get_config(self):
        return {"peak": self.peak, "warmup_steps": self.warmup_steps, "total_steps": self.total_steps}


class FloorDividedWarmupLinearDecay(WarmupLinearDecay):
    """The same schedule written with `//`: each fraction rounds down to 0, so the learning rate is 0 at every
    step (integer division where a true division was meant)."""

    def fraction(self, step):
        return ops.minimum(step // self.warmup_steps, (self.total_steps - step) // self.total_steps)


def transformer(width: int = 32) -> keras.Model:
    """A Transformer encoder block (self-attention and a feed-forward network, each with a residual and
    LayerNormalization) over token and position embeddings, averaged over positions into the class logits."""
    inputs = keras.Input((LENGTH,), dtype="int32")
    x = TokenAndPositionEmbedding(LENGTH, VOCAB, width)(inputs)
    x = layers.LayerNormalization()(x + layers.MultiHeadAttention(num_heads=2, key_dim=width // 2)(x, x))
    feed_forward = layers.Dense(width)(layers.Dense(2 * width, activation="relu")(x))
    x = layers.LayerNormalization()(x + feed_forward)
    return keras.Model(inputs, layers.Dense(CLASSES)(layers.GlobalAveragePooling1D()(x)))


def fit_transformer(attach, long: bool, schedule=WarmupLinearDecay) -> Outcome:
    """AdamW under a warm-up schedule on the marker-token task, batches of 32."""
    train, val = data.token_classes(length=LENGTH, vocab=VOCAB, classes=CLASSES)
    epochs = 20 if long else 4
    total_steps = epochs * -(-len(train[0]) // 32)
    model = transformer()
    compile_classifier(model, keras.optimizers.AdamW(schedule(3e-3, total_steps // 10, total_steps)))
    return fit_classifier(model, train, val, attach, epochs=epochs, target=0.9)


def transformer_warmup(attach, long):
    """A Transformer block text classifier trained with AdamW and a linear warm-up/decay learning-rate schedule."""
    start()
    return fit_transformer(attach, long)


def lr_zero_schedule(attach, long):
    """The Transformer with its warm-up schedule written with integer division: the learning rate is 0 throughout."""
    start()
    return fit_transformer(attach, long, schedule=FloorDividedWarmupLinearDecay)


# -- a model with its own train_step --------------------------------------------------------------------------------

class GradientTapeModel(keras.Model):
    """A model whose `train_step` is written out with `tf.GradientTape`, as the Keras guide "Customizing what happens
    in fit() with TensorFlow" does (TensorFlow only)."""

    def train_step(self, batch):
        import tensorflow as tf

        x, y = batch
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        trainable_vars = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, trainable_vars), trainable_vars)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def subclassed_train_step(attach, long):
    """The digits MLP as a subclassed `keras.Model` with its own GradientTape `train_step`."""
    start()
    sequential = mlp()
    return fit_digits(GradientTapeModel(sequential.inputs, sequential.outputs), attach, long)


CASES: list[Case] = [
    Case("keras", "digits_mlp", digits_mlp, backends=ALL_BACKENDS),
    Case("keras", "mobilenetv2", mobilenetv2, backends=()),
    Case("keras", "resnet_small", resnet_small),
    Case("keras", "bn_dropout_cnn", bn_dropout_cnn_case, backends=ALL_BACKENDS),
    Case("keras", "embedding_lstm", embedding_lstm),
    Case("keras", "transformer_warmup", transformer_warmup),
    Case("keras", "transfer_frozen_base", transfer_frozen_base),
    Case("keras", "mixed_precision", mixed_precision),
    Case("keras", "class_and_sample_weights", class_and_sample_weights, backends=ALL_BACKENDS),
    Case("keras", "multi_output", multi_output, backends=ALL_BACKENDS),
    Case("keras", "subclassed_train_step", subclassed_train_step),
    Case("keras", "mlp_lr_x1000", mlp_lr_x1000, fault="lr x1000",
         catch=("exploding_tensor", "weight_update_ratio", "exploding_gradient", "dead_relu", "loss_not_decreasing",
                "learning_rate"), cause=("learning_rate", "weight_update_ratio", "exploding_gradient"),
         backends=ALL_BACKENDS),
    Case("keras", "dead_relu_bias", dead_relu_bias, fault="ReLU biases -20: dead ReLUs", catch=("dead_relu",),
         backends=ALL_BACKENDS),
    Case("keras", "inputs_x255", inputs_x255, fault="raw 0-255 pixel inputs", catch=("input_not_normalized",)),
    Case("keras", "one_unit_softmax", one_unit_softmax, fault="Dense(1, softmax) under binary cross-entropy",
         catch=("loss_setup",)),
    Case("keras", "labels_not_class_ids", labels_not_class_ids, fault="labels / 255: all cast to class 0",
         catch=("loss_setup", "class_imbalance", "confusion")),
    Case("keras", "missing_from_logits", missing_from_logits, fault="logits into a from_logits=False loss",
         catch=("loss_setup", "output_loss_mismatch", "loss_not_decreasing")),
    Case("keras", "frozen_by_mistake", frozen_by_mistake, fault="middle Dense layer frozen",
         catch=("unchanged_tensor", "untrained_parameters"), tags=SILENT),
    Case("keras", "model_frozen", model_frozen, fault="model.trainable = False before compile",
         catch=("untrained_parameters",), tags=SILENT),
    Case("keras", "lr_zero_schedule", lr_zero_schedule, fault="schedule gives lr 0 (integer division)",
         catch=("learning_rate", "unchanged_tensor", "weight_update_ratio", "loss_not_decreasing"),
         cause=("unchanged_tensor", "weight_update_ratio", "learning_rate"), tags=SILENT),
    Case("keras", "shuffled_labels", shuffled_labels, fault="labels shuffled apart from inputs",
         catch=("loss_not_decreasing", "overfit")),
    Case("keras", "mixed_precision_spread", mixed_precision_spread),
    # healthy mixed precision skips its first steps too: the 30th in a row is the fault; JAX holds the optimizer's
    # step count outside the model during fit, so the relation is not recorded there
    Case("keras", "loss_scale_skips_every_step", loss_scale_skips_every_step,
         fault="sqrt of a zero distance under mixed_float16: every step skipped", catch=("training_relations",),
         onset=29, backends=("tensorflow", "torch"), tags=SILENT),
]
