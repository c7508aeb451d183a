"""Partitioned steps are bit-equal to tf.function at every partition size (Grappler on).

Grappler optimises each partition's function on its own and the plain
`tf.function` whole; its arithmetic optimizer regroups sums (a tree of adds
becomes one AddN whose inputs it sorts by name, a common factor is hoisted
out of a sum of products), which changes float results in the last bits
when a partition boundary splits the pattern (`tfmem/plan/units.py`, rule 5).
Three training steps (an MLP with three-term residual sums and a convnet
summing three parallel convolutions, SGD written by hand; a Keras model with
BatchNormalization, a residual Add and Adam; a Keras ConvNeXt block, whose
GELU gradient is a chain of products, and again with approximate GELU, whose
`x ** 3` Grappler writes as a product, its constant multiplied into the factor
with the smaller name: `tfmem/tf2/cubes.py`; the MLP
computing `x * 0.25` twice, two equal computations Grappler deduplicates,
keeping a copy a partition would not keep: `tfmem/tf2/dedup.py`; approximate
GELU alone, whose power's gradient has an exponent the whole function folds to
a constant, and whose constants Grappler multiplies in where it meets them in
node order: `tfmem/tf2/compile.py`) run as plain `tf.function` and as
`tfmem.function` at several partition sizes, from identical variables; losses
and every variable after every step must be bit-equal.

One fresh process: intra-op threads pinned to one (the plain run is then
deterministic on any machine), oneDNN off; it prints one JSON line.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (200, 50, 20, 5)
MODELS = ("mlp", "convnet", "residual", "keras", "equal_ops", "keras_sgd", "convnext",
          "power_gradient", "convnext_tanh", "gelu_forward")
TWO_THREAD_MODELS = ("keras_sgd", "keras", "residual")

SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
import keras
import tfmem
from tfmem.cli.tf2_models import convnext_block, make_step  # as tools/bench_tf2.py times
tf.config.threading.set_intra_op_parallelism_threads(int(sys.argv[3]))
tf.config.threading.set_inter_op_parallelism_threads(2)


def mlp(seed, equal_ops=False):
    rng = np.random.default_rng(seed)
    ws = [tf.Variable(rng.standard_normal((64, 64)).astype(np.float32) * 0.1) for _ in range(12)]
    bs = [tf.Variable(np.zeros(64, np.float32)) for _ in range(12)]
    variables = ws + bs

    def step(x):
        with tf.GradientTape() as tape:
            # equal_ops: skip * 0.25 of the second layer is x * 0.25 again, an equal
            # computation Grappler's common-subexpression pass deduplicates
            skip, h = (x if equal_ops else tf.sin(x)), x
            for w, b in zip(ws, bs):
                skip, h = h, tf.nn.relu(h @ w + b) + h * 0.5 + skip * 0.25
            loss = tf.reduce_mean(h * h)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.01 * g)
        return loss
    x = tf.constant(np.random.default_rng(1).standard_normal((128, 64)).astype(np.float32))
    return step, variables, (x,)


def convnet(seed):
    rng = np.random.default_rng(seed)
    kernels = [tf.Variable(rng.standard_normal((3, 3, 8, 8)).astype(np.float32) * 0.2)
               for _ in range(6)]
    stem = tf.Variable(rng.standard_normal((3, 3, 3, 8)).astype(np.float32) * 0.2)
    biases = [tf.Variable(np.zeros(8, np.float32)) for _ in range(2)]
    dense = tf.Variable(rng.standard_normal((8, 10)).astype(np.float32) * 0.1)
    variables = [stem] + kernels + biases + [dense]
    velocity = [tf.Variable(tf.zeros_like(v)) for v in variables]

    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.nn.conv2d(x, stem, 1, "SAME")
            for block, b in enumerate(biases):  # three parallel convolutions, summed
                a, c, d = (tf.nn.conv2d(h, k, 1, "SAME") for k in kernels[3 * block:3 * block + 3])
                h = tf.nn.relu(tf.nn.bias_add(a + c * 0.5 + d, b))
            logits = tf.reduce_mean(h, axis=[1, 2]) @ dense
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        for v, m, g in zip(variables, velocity, tape.gradient(loss, variables)):
            m.assign(0.9 * m + g)
            v.assign_sub(0.02 * m)
        return loss
    r = np.random.default_rng(2)
    x = tf.constant(r.standard_normal((8, 16, 16, 3)).astype(np.float32))
    y = tf.constant(r.integers(0, 10, 8).astype(np.int32))
    return step, variables + velocity, (x, y)


def residual(seed):
    # A convnet whose blocks sum conv(h) + h + skip: the sum's leaves lie on one path
    # (h's producer reaches the convolution), so the planner cannot keep them together.
    rng = np.random.default_rng(seed)
    stem = tf.Variable(rng.standard_normal((3, 3, 3, 8)).astype(np.float32) * 0.2)
    kernels = [tf.Variable(rng.standard_normal((3, 3, 8, 8)).astype(np.float32) * 0.2)
               for _ in range(4)]
    biases = [tf.Variable(np.zeros(8, np.float32)) for _ in range(4)]
    dense = tf.Variable(rng.standard_normal((8, 10)).astype(np.float32) * 0.1)
    variables = [stem] + kernels + biases + [dense]

    def step(x, y):
        with tf.GradientTape() as tape:
            h = skip = tf.nn.relu(tf.nn.conv2d(x, stem, 1, "SAME"))
            for k, b in zip(kernels, biases):
                h, skip = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, k, 1, "SAME") + h + skip,
                                                     b)), h
            logits = tf.reduce_mean(h, axis=[1, 2]) @ dense
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.05 * g)
        return loss
    r = np.random.default_rng(2)
    x = tf.constant(r.standard_normal((8, 16, 16, 3)).astype(np.float32))
    y = tf.constant(r.integers(0, 10, 8).astype(np.int32))
    return step, variables, (x, y)


def keras_model(seed, optimizer="adam"):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    h = shortcut = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(keras.layers.Add()([h, shortcut]))
    h = keras.layers.Dense(32, activation="relu")(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    # SGD with momentum reads each gradient once, through the IdentityN Keras applies
    # gradients with: a gamma's gradient (AddN * Rsqrt) times the learning rate is then
    # one chain of products in the whole function, which Grappler reorders (lr * AddN)
    # * Rsqrt; Adam reads each gradient twice, so it forms no such chain
    optimizer = (keras.optimizers.Adam(1e-2) if optimizer == "adam"
                 else keras.optimizers.SGD(0.01, momentum=0.9))
    step = make_step(tf, keras, model, optimizer)
    r = np.random.default_rng(2)
    x = tf.constant(r.standard_normal((16, 16, 16, 3)).astype(np.float32))
    y = tf.constant(r.integers(0, 10, 16).astype(np.int32))
    return step, model.variables + optimizer.variables, (x, y)


def power_gradient(seed):
    # Approximate GELU: the gradient of x ** 3 is 3 * x ** (3 - 1), whose exponent the
    # whole function folds to a constant (and x ** 2 to a square)
    r = np.random.default_rng(seed)
    w = tf.Variable(r.standard_normal((16, 16)).astype(np.float32))

    def step(x):
        with tf.GradientTape() as tape:
            h = tf.nn.gelu(tf.matmul(x, w), approximate=True)
            loss = tf.reduce_sum(h * h)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        return loss
    return step, [w], (tf.constant(r.standard_normal((4, 16)).astype(np.float32)),)


def gelu_forward(seed):
    # Approximate GELU without a gradient: no square of x elsewhere, so the whole function
    # multiplies x ** 3 as x * (Grappler's own square), named after the power
    r = np.random.default_rng(seed)
    ws = [tf.Variable(r.standard_normal((32, 32)).astype(np.float32) * 0.3) for _ in range(4)]

    def step(x):
        for w in ws:
            x = tf.nn.gelu(tf.matmul(x, w), approximate=True)
        return tf.reduce_sum(x)
    return step, ws, (tf.constant(r.standard_normal((8, 32)).astype(np.float32)),)


def convnext(seed, approximate=False):
    # One ConvNeXt block: DepthwiseConv2D 7x7, LayerNormalization, Dense 4x, GELU (exact,
    # Keras's default: its Erfc gradient is a chain of products starting at an op a
    # control edge leaves, see tfmem/plan/units.py rule 5), Dense, layer scale, residual add
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((16, 16, 3))
    h = convnext_block(keras, keras.layers.Conv2D(16, 2, strides=2)(inputs), approximate)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    optimizer = keras.optimizers.Adam(1e-2)
    step = make_step(tf, keras, model, optimizer)
    r = np.random.default_rng(2)
    x = tf.constant(r.standard_normal((8, 16, 16, 3)).astype(np.float32))
    y = tf.constant(r.integers(0, 10, 8).astype(np.int32))
    return step, model.variables + optimizer.variables, (x, y)


BUILD = dict(mlp=mlp, convnet=convnet, residual=residual, keras=keras_model,
             equal_ops=lambda seed: mlp(seed, equal_ops=True),
             keras_sgd=lambda seed: keras_model(seed, optimizer="sgd"), convnext=convnext,
             power_gradient=power_gradient, gelu_forward=gelu_forward,
             convnext_tanh=lambda seed: convnext(seed, approximate=True))


def differing(variables, others):
    return [v.name for v, w in zip(variables, others) if not np.array_equal(v.numpy(), w.numpy())]


out = {}
for name in sys.argv[1].split(","):
    for size in [int(s) for s in sys.argv[2].split(",")]:
        plain_step, plain_vars, args = BUILD[name](0)
        tfmem_step, tfmem_vars, _ = BUILD[name](0)
        again_step, again_vars, _ = BUILD[name](0)  # a second plain copy: is plain deterministic?
        plain, again = tf.function(plain_step), tf.function(again_step)
        partitioned = tfmem.function(tfmem_step, partition_size=size)
        steps = []
        for _ in range(3):
            expected, got, repeated = (f(*args).numpy() for f in (plain, partitioned, again))
            steps.append(dict(
                loss_equal=bool(expected == got),
                variables_differing=differing(plain_vars, tfmem_vars),
                plain_deterministic=bool(expected == repeated) and not differing(plain_vars,
                                                                                 again_vars)))
        out[f"{name}@{size}"] = dict(steps=steps, partitions=partitioned.last_step.partitions,
                                     ops=partitioned.plan(*args).num_ops)
print(json.dumps(out))
"""


def _run(models, sizes, intra_op_threads):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(models), ",".join(map(str, sizes)),
         str(intra_op_threads)],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(run, model, size):
    if size < run["ops"]:
        assert run["partitions"] > 1, run  # the step is cut, or the test proves nothing
    for number, step in enumerate(run["steps"], 1):
        assert step["plain_deterministic"], \
            f"two tf.function copies of {model} differ at step {number}: nothing to compare"
        assert step["loss_equal"] and not step["variables_differing"], \
            f"step {number} of {model} at partition_size={size} differs from tf.function: {step}"


@pytest.fixture(scope="module")
def runs():
    return _run(MODELS, SIZES, intra_op_threads=1)


@pytest.fixture(scope="module")
def runs_two_threads():
    return _run(TWO_THREAD_MODELS, SIZES, intra_op_threads=2)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.slow
def test_partitioned_steps_are_bit_equal_to_tf_function(runs, model, size):
    _check(runs[f"{model}@{size}"], model, size)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("model", TWO_THREAD_MODELS)
@pytest.mark.slow
def test_bit_equal_with_two_intra_op_threads(runs_two_threads, model, size):
    """Eigen splits reductions by the thread count; the plain run stays deterministic
    (checked), and so must the partitioned one's agreement with it."""
    _check(runs_two_threads[f"{model}@{size}"], model, size)
