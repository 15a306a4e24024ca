"""A Keras fit over two CPU devices, with tripwire's callback: TensorFlow's MirroredStrategy (`mirrored`) or Keras'
DataParallel distribution on JAX (`data_parallel`). The devices must be made before the backend starts: hence a
process of its own.

usage: train_keras_distributed.py RUN_URL {mirrored,data_parallel} REPLICAS [--nan-at STEP]
--nan-at: that step's batch is scaled by 1e20 (the squared features overflow).
Prints "learned BEFORE AFTER" (the loss of the first and last epoch) and the exploding_tensor verdict, if any.
"""

import argparse
import os
import sys

import contextlib  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
MIRRORED = sys.argv[2] == "mirrored"
os.environ["KERAS_BACKEND"] = "tensorflow" if MIRRORED else "jax"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
if MIRRORED:
    import tensorflow as tf

    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import helpers  # noqa: E402
from tripwire.plugins.keras import TripwireCallback  # noqa: E402


class Square(keras.layers.Layer):
    """x * x: overflows float32 once its input passes ~1.8e19."""

    def call(self, x):
        return x * x


args = argparse.ArgumentParser()
args.add_argument("run_url")
args.add_argument("distribution", choices=["mirrored", "data_parallel"])
args.add_argument("replicas", type=int)
args.add_argument("--nan-at", type=int, default=None)
a = args.parse_args()

(x, y), _ = helpers.digits()
x, y = x[:14 * 32].copy(), y[:14 * 32]
if a.nan_at is not None:
    x[a.nan_at * 32:(a.nan_at + 1) * 32] *= 1e20
keras.utils.set_random_seed(0)
if MIRRORED:
    scope = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(a.replicas)]).scope()
else:
    keras.distribution.set_distribution(keras.distribution.DataParallel(
        devices=keras.distribution.list_devices()[:a.replicas]))
    scope = contextlib.nullcontext()
with scope:
    inputs = keras.Input((64,))
    h = keras.layers.Dropout(0.2, name="drop")(keras.layers.Dense(32, name="first")(inputs))
    h = Square(name="square")(keras.layers.Dense(32, name="second")(h))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax", name="out")(h))
    model.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy")
callback = TripwireCallback({"collections": {"weights": {}, "gradients": {}, "losses": {}}, "sampling": {"every": 5},
                             "rules": [{"rule": "exploding_tensor", "actions": ["log", "stop"]}]}, out_dir=a.run_url)
history = model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[callback])
losses = history.history["loss"]
print("learned", losses[0], losses[-1])
for verdict in callback.verdicts:
    if verdict.rule == "exploding_tensor":
        print("verdict", verdict.step, verdict.message)
