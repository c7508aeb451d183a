"""Long gradient sums keep their addends whole only where Grappler reorders sums.

Grappler's arithmetic optimizer sorts an AddN's inputs by name, so tfmem keeps
such a sum in one partition with its addends (plan/units.py, rule 5).  A
session that runs no arithmetic optimizer adds them in input order, whichever
partition made them: `tfmem.Session` (Grappler off) then plans the sum alone.

The model: an unrolled RNN whose per-frame losses are weighted 1e-4 .. 1e4, so
the output weight's gradient is an AddN of twelve addends of very different
magnitudes whose float sum depends on the order (frames are named so that name
order is not input order: out_10, out_11 sort before out_2).
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

import tfmem
from tfmem.plan.analyse import analyse
from tfmem.plan.units import units
from tfmem.run.compiling import regrouping

tf1 = tf.compat.v1
FRAMES, BATCH, WIDTH = 12, 4, 16
STEPS = 3


def _threads(config=None):
    config = config if config is not None else tf1.ConfigProto()
    config.intra_op_parallelism_threads = 1
    config.inter_op_parallelism_threads = 2
    return config


def _rnn():
    """(graph, init, train_op, [loss, w_out's gradient], feed, variables) of a 12-frame RNN
    trained by SGD."""
    rng = np.random.default_rng(7)
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [FRAMES, BATCH, WIDTH], name="x")
        weights = {name: tf1.get_variable(name, initializer=(
            rng.standard_normal((WIDTH, WIDTH)) * 0.3).astype(np.float32))
            for name in ("w_in", "w_rec", "w_out")}
        h = tf.zeros([BATCH, WIDTH])
        losses = []
        for t in range(FRAMES):
            with tf.name_scope(f"out_{t}"):  # out_10, out_11 sort before out_2
                h = tf.tanh(x[t] @ weights["w_in"] + h @ weights["w_rec"])
                out = h @ weights["w_out"]
                losses.append(10.0 ** (t % 9 - 4) * tf.reduce_mean(out * out))
        loss = tf.add_n(losses)
        grads = tf1.train.GradientDescentOptimizer(1e-6).compute_gradients(loss)
        train = tf1.train.GradientDescentOptimizer(1e-6).apply_gradients(grads)
        init = tf1.global_variables_initializer()
    feed = {x: rng.standard_normal((FRAMES, BATCH, WIDTH)).astype(np.float32)}
    # w_out's gradient (the long sum) is fetched too: an update of 1e-6 hides its last
    # bits.  (w_in's and w_rec's sums chain through the frames, one addend's producer
    # reaching the next: rule 5 leaves those to partitioning, see units.py.)
    grad_out = next(g for g, v in grads if v is weights["w_out"])
    return graph, init, train, [loss, grad_out], feed, list(weights.values())


def _steps(session, init, train, loss, feed, variables):
    """Losses and variables after each training step; on a TFMemSession, checks that
    every training step ran in more than one partition."""
    session.run(init)
    out = []
    for _ in range(STEPS):
        out.extend(session.run([train, loss], feed)[1])
        if isinstance(session, tfmem.TFMemSession):
            assert session.last_step.partitions > 1
        out.extend(session.run(variables))
    return out


def _assert_bit_equal(got, expected):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)


def _gradient_sum(view):
    """The AddN of w_out's gradient: the longest AddN of the view."""
    sums = [n for n in view.nodes.values() if n.type == "AddN"]
    return max(sums, key=lambda n: len(n.inputs))


def _unit_of(view, name):
    return next(set(unit) for unit in units(view) if name in unit)


@pytest.mark.parametrize("partition_size", [1, 3, 8])
def test_tfmem_session_splits_long_sums_and_stays_bit_equal(partition_size):
    """Grappler off (tfmem.Session): the sum's addends are not joined to it, and training
    is bit-equal to a plain session with the same config."""
    graph, init, train, loss, feed, variables = _rnn()
    tfs = tfmem.Session(graph=graph, config=_threads(), partition_size=partition_size)
    plain = tf1.Session(graph=graph, config=tfmem.session_config(_threads()))
    try:
        plan = tfs.plan([train, loss], feed)
        assert not plan.view.regrouped_arithmetic
        total = _gradient_sum(plan.view)
        assert len(total.inputs) == FRAMES
        assert _unit_of(plan.view, total.name) == {total.name}
        if partition_size == 1:
            home = next(p for p in plan.partitions if total.name in p.ops)
            assert home.ops == (total.name,)
        got = _steps(tfs, init, train, loss, feed, variables)
        _assert_bit_equal(got, _steps(plain, init, train, loss, feed, variables))
    finally:
        tfs.close()
        plain.close()


@pytest.mark.parametrize("partition_size", [1, 8])
def test_a_default_session_keeps_the_sum_with_its_addends_and_stays_bit_equal(partition_size):
    """Grappler on (a default config): the rule still joins the sum and its twelve
    producers, and training is bit-equal to the plain session."""
    graph, init, train, loss, feed, variables = _rnn()
    tfs = tfmem.TFMemSession(tf1.Session(graph=graph, config=_threads()),
                             partition_size=partition_size)
    plain = tf1.Session(graph=graph, config=_threads())
    try:
        plan = tfs.plan([train, loss], feed)
        assert plan.view.regrouped_arithmetic
        total = _gradient_sum(plan.view)
        producers = {t.rpartition(":")[0] for t in total.inputs}
        assert producers | {total.name} <= _unit_of(plan.view, total.name)
        got = _steps(tfs, init, train, loss, feed, variables)
        _assert_bit_equal(got, _steps(plain, init, train, loss, feed, variables))
    finally:
        tfs.close()
        tfs.session.close()
        plain.close()


def _config(setting):
    config = tf1.ConfigProto()
    if setting == "disable_meta_optimizer":
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    elif setting == "arithmetic_off":
        config.graph_options.rewrite_options.arithmetic_optimization = \
            rewriter_config_pb2.RewriterConfig.OFF
    elif setting == "arithmetic_on":
        config.graph_options.rewrite_options.arithmetic_optimization = \
            rewriter_config_pb2.RewriterConfig.ON
    elif setting == "place_pruned_graph":
        config.graph_options.place_pruned_graph = True
    return config


@pytest.mark.parametrize("setting", ["default", "disable_meta_optimizer", "arithmetic_off",
                                     "arithmetic_on", "place_pruned_graph"])
def test_the_config_check_matches_the_order_tensorflow_adds_in(setting):
    """An AddN of eight MatMuls named out of order: it adds in name order exactly when
    runs_arithmetic_optimizer says the config runs the optimizer."""
    names = ["z", "m", "a", "q", "b", "y", "c", "k"]
    rng = np.random.default_rng(0)
    values = [(rng.standard_normal((16, 16)) * 10.0 ** (3 * (i % 3) - 3)).astype(np.float32)
              for i in range(len(names))]
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [16, 16])
        leaves = [tf.matmul(x, tf.constant(v), name=n) for n, v in zip(names, values)]
        total = tf.add_n(leaves)
    with tf1.Session(graph=graph, config=_threads(_config(setting))) as sess:
        got, parts = sess.run([total, leaves], {x: np.eye(16, dtype=np.float32) + 0.37})

    def in_order(order):
        acc = parts[order[0]]
        for i in order[1:]:
            acc = acc + parts[i]
        return acc

    by_input = in_order(range(len(names)))
    by_name = in_order(sorted(range(len(names)), key=names.__getitem__))
    assert not np.array_equal(by_input, by_name)  # the two orders are distinguishable
    runs = regrouping.runs_arithmetic_optimizer(_config(setting))
    assert runs == (setting in ("default", "arithmetic_on"))
    np.testing.assert_array_equal(got, by_name if runs else by_input)


def test_a_sum_whose_addends_lie_on_one_path_keeps_the_path_apart():
    """Keeping a sum with its addends joins them into one unit; where one addend reaches
    another (a residual sum: the block's input and its output), that would make the
    whole block between them one unit, which no partition size could split.  Such a
    sum keeps its producers apart: a 40-op block stays 40 units."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [8, 8], name="x")
        skip = tf.tanh(x, name="skip")
        h = skip
        for i in range(40):
            h = tf.sin(h, name=f"block_{i}")
        total = tf.add_n([skip, h, tf.cos(x, name="side")], name="total")
    view = analyse([total], [], [x])
    groups = units(view)
    assert max(len(unit) for unit in groups) < 10, sorted(map(len, groups))[-3:]
