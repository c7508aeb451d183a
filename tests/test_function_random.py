"""Random ops in a tfmem.function draw what tf.function draws.

A tf.function keeps one stream per random op per trace (ConcreteFunction): a
new input shape that retraces gets new streams, a shape served by a generic
trace (reduce_retracing) continues its streams.  tfmem.function must draw the
same numbers across steps, retraces and, in budget mode, the plans it makes
per fed shape of one trace.  The step mixes shapes computed in-graph (the
dropout-like mask), a fixed-shape normal draw and a shuffle; the plain side
is a tf.function of an identically built step under the same global seed.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem

SHAPES = [4, 6, 4, 4, 6, 5, 4, 5, 7]


def _step(op_seeds):
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.standard_normal((8, 8)).astype(np.float32))

    def seed(value):
        return value if op_seeds else None

    def step(x):
        h = x @ w
        h = tf.where(tf.random.uniform(tf.shape(h), seed=seed(7)) > 0.5, h, 0.0)
        noise = tf.random.normal([3], seed=seed(3))
        order = tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=seed(5))
        w.assign_add(0.01 * tf.reduce_mean(h) * tf.ones_like(w))
        return {"loss": tf.reduce_sum(h) + tf.reduce_sum(noise), "order": order}
    return step, w


@pytest.mark.parametrize("op_seeds", [True, False], ids=["op-seeded", "graph-seeded"])
@pytest.mark.parametrize("options", [
    dict(partition_size=3),
    dict(partition_size=3, reduce_retracing=True),
    dict(device_memory_budget="64MiB", reduce_retracing=True),
], ids=["size3", "size3-generic", "budget-generic"])
def test_random_ops_draw_tf_functions_numbers_across_shapes_and_plans(options, op_seeds):
    tf_options = {k: v for k, v in options.items() if k == "reduce_retracing"}
    tf.random.set_seed(11)
    step, plain_w = _step(op_seeds)
    plain = tf.function(step, **tf_options)
    expected = [plain(tf.ones((n, 8))) for n in SHAPES]
    tf.random.set_seed(11)
    step, w = _step(op_seeds)
    wrapped = tfmem.function(step, **options)
    for n, want in zip(SHAPES, expected):
        got = wrapped(tf.ones((n, 8)))
        assert wrapped.last_step.partitions >= 1
        np.testing.assert_array_equal(got["loss"].numpy(), want["loss"].numpy(), err_msg=str(n))
        np.testing.assert_array_equal(got["order"].numpy(), want["order"].numpy())
    np.testing.assert_array_equal(w.numpy(), plain_w.numpy())
    if "partition_size" in options:
        assert wrapped.last_step.partitions > 1


def _masked_mlp():
    weights = [tf.Variable(tf.eye(256) * 0.5) for _ in range(6)]

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.nn.relu(h @ w)
                h = tf.where(tf.random.uniform(tf.shape(h), seed=1) > 0.5, h, 0.0)
            loss = tf.reduce_sum(h)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(1e-6 * g)
        # Draws inside a loop and a cond: stream ops that are calls, cut around, not hoisted.
        noise = tf.while_loop(lambda i, a: i < 3,
                              lambda i, a: (i + 1, a + tf.random.uniform([4], seed=9)),
                              (0, tf.zeros([4])))[1]
        flip = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.random.normal([2], seed=2),
                       lambda: tf.zeros([2]))
        return loss, tf.random.normal([3], seed=4), noise, flip
    return step, weights


def test_a_shape_that_needs_a_new_plan_continues_the_random_streams(caplog):
    """Budget mode: a shape no earlier plan of the trace fits gets a plan of its own
    (more partitions); its random ops continue the streams the first plan drew from,
    as tf.function's one trace does, because each stream op runs in a function shared
    by every plan of the trace (tfmem.tf2.streams).  On main the 4096-row step, and
    every step after it, drew from restarted streams."""
    shapes = [4, 5, 1 << 12, 4, 1 << 12, 5]  # 4096 rows: 4 MiB a tensor, kept for gradients
    tf.random.set_seed(3)
    step, plain_weights = _masked_mlp()
    plain = tf.function(step, reduce_retracing=True)
    expected = [plain(tf.ones((n, 256))) for n in shapes]
    tf.random.set_seed(3)
    step, weights = _masked_mlp()
    wrapped = tfmem.function(step, device_memory_budget="64MiB", reduce_retracing=True)
    partitions = []
    with caplog.at_level("WARNING", logger="tfmem"):
        for n, want in zip(shapes, expected):
            got = wrapped(tf.ones((n, 256)))
            partitions.append(wrapped.last_step.partitions)
            for value, plain_value in zip(got, want):
                np.testing.assert_array_equal(value.numpy(), plain_value.numpy(), err_msg=str(n))
    assert partitions[2] > partitions[0] == partitions[3]  # two plans, interleaved
    for w, plain_w in zip(weights, plain_weights):
        np.testing.assert_array_equal(w.numpy(), plain_w.numpy())
    assert not [r for r in caplog.records if "stream" in r.getMessage()]
