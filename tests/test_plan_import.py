"""One import per plan (plan_import) against plain Session.run and the per-partition rewrite.

Every partitioned test of the suite runs through plan_import on a local session;
these check what is particular to it: several outputs of one op crossing
partitions (their ticket ops must get distinct names), swapped and kept
tensors, control edges between copies, and that the graph it builds holds
the same ops as the per-partition rewrite, with bitwise equal results.  And
the deferred prediction of a plan that swaps nothing: the first step skips
it, `memory_report` still gives the same figures as an eager prediction.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem

tf1 = tf.compat.v1


def _model():
    """A step whose split outputs (three tensors of one op) cross partitions."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [8, 12], name="x")
        w = tf1.get_variable("w", initializer=np.linspace(-1, 1, 144, dtype=np.float32)
                             .reshape(12, 12), use_resource=True)
        h = tf.matmul(x, w)
        a, b, c = tf.split(h, 3, axis=1)
        for _ in range(6):
            a = tf.tanh(a) * 1.5
        with tf.control_dependencies([a.op]):
            b = tf.identity(b)
        loss = tf.reduce_sum(a * b + tf.square(c))
        train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
        init = tf1.global_variables_initializer()
        weights = w.read_value()
    graph.weights = weights.name
    data = np.random.RandomState(0).standard_normal((8, 12)).astype(np.float32)
    return graph, x, loss, train, init, data


def _config():
    return tfmem.session_config(tf1.ConfigProto(intra_op_parallelism_threads=1,
                                                inter_op_parallelism_threads=1))


def _steps(one_import, swap, steps=3, stretched=True):
    graph, x, loss, train, init, data = _model()
    options = tfmem.Options(one_import=one_import, stretches=stretched)
    with tf1.Session(graph=graph, config=_config()) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=4, swap=swap, swap_distance=1,
                                 options=options)
        sess.run(init)
        before = graph.version
        losses = [tfs.run([train, loss], {x: data})[1] for _ in range(steps)]
        plan = tfs.plan([train, loss], {x: data})
        # the per-partition import maps each deleter's edge to its last reader through
        # a constant (rewrite.rewrite_partition: input_map names tensors only)
        gates = sum(1 for op in graph.get_operations()
                    if op.type == "Const" and "_in/freed" in op.name)
        return losses, graph.version - before - gates, plan, sess.run(graph.weights)


def _plain(steps=3):
    graph, x, loss, train, init, data = _model()
    with tf1.Session(graph=graph, config=_config()) as sess:
        sess.run(init)
        losses = [sess.run([train, loss], {x: data})[1] for _ in range(steps)]
        return losses, sess.run(graph.weights)


@pytest.mark.parametrize("swap", ["none", "all"])
def test_one_import_equals_plain_and_the_per_partition_rewrite(swap):
    plain_losses, plain_w = _plain()
    losses, added, plan, w = _steps(True, swap, stretched=False)
    old_losses, old_added, _, old_w = _steps(False, swap)
    stretched_losses, _, _, stretched_w = _steps(True, swap)
    assert len(plan.partitions) > 3
    split = [t for t in plan.transfers if t.tensor.startswith("split:")]
    assert len(split) >= 2, "two outputs of one op cross partitions"
    if swap == "all":
        assert all(t.swapped for t in plan.transfers)
    else:
        assert all(t.kept for t in plan.transfers)
    np.testing.assert_array_equal(losses, plain_losses)
    np.testing.assert_array_equal(w, plain_w)
    np.testing.assert_array_equal(old_losses, plain_losses)
    np.testing.assert_array_equal(stretched_losses, plain_losses)
    np.testing.assert_array_equal(stretched_w, plain_w)
    assert added == old_added, "the same ops as the per-partition rewrite (less its gates)"


def test_prediction_of_a_plan_that_swaps_nothing_waits_for_its_reader():
    graph, x, loss, train, init, data = _model()
    with tf1.Session(graph=graph, config=_config()) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=4, swap="none")
        sess.run(init)
        tfs.run([train, loss], {x: data})
        assert tfs.last_compile.simulate_time < 0.05  # not predicted on the first step
        eager = tfs.simulate([train, loss], {x: data})
        report = tfs.memory_report()
        assert report.predicted_device_peak == eager.peak_device > 0
        assert report.predicted_partition_peaks == tuple(p.device_peak
                                                         for p in eager.partitions)
