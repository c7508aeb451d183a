"""`model.fit` through tfmem.keras.partitioned is bit-equal to plain `fit` on a ConvNeXt model.

The model users bring with depthwise convolutions, LayerNormalization, GELU and
a per-channel layer scale (two ConvNeXt blocks, Adam), once with Keras's exact
GELU and once with its tanh approximation: GELU's products are where
partition boundaries used to change the last bits (plan/units.py rule 5,
tfmem/tf2/cubes.py).  Plain `fit` and partitioned `fit` run two epochs from the
same seeds in one fresh process per kernel path (one intra-op thread, op
determinism on); every loss, every weight and the evaluation after training
must be equal, bit for bit.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
import keras
import tfmem
from tfmem.cli.tf2_models import convnext_block
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
tf.config.experimental.enable_op_determinism()


def build(approximate):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(16, 2, strides=2)(inputs)
    for _ in range(2):
        h = convnext_block(keras, h, approximate)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


r = np.random.default_rng(0)
x = r.standard_normal((48, 16, 16, 3)).astype(np.float32)
y = r.integers(0, 10, 48).astype(np.int32)
out = {}
for approximate in (False, True):
    plain = build(approximate)
    expected = plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
    for size in (50, 20):
        model = tfmem.keras.partitioned(build(approximate), partition_size=size)
        got = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0).history
        step = tfmem.keras.train_step_of(model)
        out[f"approximate={approximate}@{size}"] = dict(
            losses=got == expected, plain=expected["loss"], tfmem=got["loss"],
            weights=[w.path for w, v in zip(plain.weights, model.weights)
                     if not np.array_equal(w.numpy(), v.numpy())],
            evaluation=model.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0),
            partitions=step.last_step.partitions)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["0", "1"])
def test_fit_is_bit_equal_to_plain_fit(onednn):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          cwd=ROOT, timeout=900,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    for name, run in runs.items():
        assert run["partitions"] > 1, (name, run)  # the step is cut, or nothing is shown
        assert run["losses"] and not run["weights"] and run["evaluation"], (name, run)
