"""Budget mode plans a tfmem.function with the device holding what its first step leaves.

A Keras optimizer built inside the traced step (on its first `apply`) makes its slots
share buffers: after the trace the device holds a fraction of them, and each slot's
first update copies its buffer.  Budget mode plans with what the device holds before
the step, so without tfmem.tf2.own_buffers the first step's plan counted on memory
the step itself took (Keras ResNet-50 with Adam ran out of memory in it).

One fresh process per kernel path, a BFC allocator capped far above the step: an
MLP of 4 MiB layers, Adam built lazily, in budget mode.  The device bytes budget mode
planned with must be what the device holds after the first step (within a MiB), and
the losses and weights must be tf.function's, bit for bit.
"""

import json
import subprocess
import sys

import pytest

from tfmem.cli import child_env

SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
import keras
import tfmem
from tfmem.memory import budget
from tfmem.run.placement import accelerator

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
planned_with = []
fit = budget.fit


def recording_fit(*args, **kwargs):
    planned_with.append(kwargs["resident_bytes"])
    return fit(*args, **kwargs)


budget.fit = recording_fit


def in_use():
    return accelerator.device_memory("CPU:0")["current"]


def model_and_step():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((1024,))] +
                             [keras.layers.Dense(1024, activation="tanh") for _ in range(4)])
    optimizer = keras.optimizers.Adam(1e-3)

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss
    return model, step


x = tf.constant(np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32))
model, step = model_and_step()
partitioned = tfmem.function(step, device_memory_budget="256MiB")
losses = [float(partitioned(x))]
after_first = in_use()
losses += [float(partitioned(x)) for _ in range(2)]
plain_model, plain_step = model_and_step()
plain_step = tf.function(plain_step)
plain_losses = [float(plain_step(x)) for _ in range(3)]
print(json.dumps(dict(planned_with=planned_with, after_first=after_first, losses=losses,
                      plain_losses=plain_losses,
                      same_weights=all(np.array_equal(a.numpy(), b.numpy()) for a, b in
                                       zip(model.weights, plain_model.weights)))))
"""


@pytest.mark.parametrize("onednn", [False, True], ids=["eigen", "onednn"])
def test_first_plan_counts_the_optimizer_slots_the_first_step_copies(onednn):
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600, env=child_env.child_env(cap_mib=1024, onednn=onednn))
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    first_plan = figures["planned_with"][0]
    # Adam's slots for 16 MiB of weights: 32 MiB, all of it held before the step is planned.
    assert abs(figures["after_first"] - first_plan) <= 1 << 20, figures
    assert figures["losses"] == figures["plain_losses"], figures
    assert figures["same_weights"], figures


def test_a_variable_without_a_copy_kernel_is_left_as_it_is(monkeypatch):
    """Where the device has no DeepCopy kernel for a variable's dtype (TensorFlow raises
    NotFoundError), that variable keeps its buffer and the others are still copied."""
    import tensorflow as tf

    from tfmem.tf2 import own_buffers

    weights = tf.Variable([1.0, 2.0])
    steps = tf.Variable(3, dtype=tf.int64)
    copy = tf.raw_ops.DeepCopy
    copied = []

    def deep_copy(x):
        if x.dtype == tf.int64:
            raise tf.errors.NotFoundError(None, None, "no DeepCopy kernel for int64 here")
        copied.append(x.dtype)
        return copy(x=x)

    monkeypatch.setattr(tf.raw_ops, "DeepCopy", deep_copy)
    own_buffers.own_buffers([steps, weights])
    assert copied == [tf.float32]
    assert weights.numpy().tolist() == [1.0, 2.0] and int(steps.numpy()) == 3
