"""Requests that change between steps: batch size, the set of feeds, a growing graph.

Each step is compared with plain Session.run on the same graph (two sessions,
the same initial state), so state carried from step to step is checked too.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.memory import budget as _budget
from tfmem.cli import models
from conftest import ATOL, RTOL, assert_same_result, build_mlp, check_plan

tf1 = tf.compat.v1

BATCHES = (8, 2, 5, 8, 1, 5, 2)
LARGE = 256


def _batch(model, step, size):
    data = model.data[step % len(model.data)]
    reps = -(-size // 8)
    return {model.x: np.tile(data[model.x], (reps, 1))[:size] * (1 + 0.1 * step),
            model.y: np.tile(data[model.y], reps)[:size]}


@pytest.mark.parametrize("swap, prefetch", [("all", 1), ("auto", 0), ("none", 2)])
def test_batch_size_changes_between_steps(swap, prefetch, sessions):
    model = build_mlp("adam")
    plain = sessions(model.graph)
    tfs = tfmem.TFMemSession(sessions(model.graph), partition_size=3, swap=swap, prefetch=prefetch,
                             options=tfmem.Options(swap_min_bytes=0))
    plain.run(model.init)
    tfs.run(model.init)
    fetches = [model.train, model.loss]
    plan = tfs.plan(fetches, feed_dict=_batch(model, 0, 8))
    if swap != "none":
        assert any(t.swapped for t in plan.transfers)
    pool = tfs.host_buffers
    for rounds in range(2):
        if rounds == 1:
            allocations = pool.allocations
        for step, size in enumerate(BATCHES):
            feed = _batch(model, step, size)
            exp = plain.run(fetches, feed_dict=feed)
            got = tfs.run(fetches, feed_dict=feed)
            assert_same_result(exp, got)
            assert pool.in_use_bytes == 0
            assert tfs.plan(fetches, feed_dict=feed) is plan  # one plan serves every batch size
    assert pool.allocations == allocations, "sizes seen before allocated host buffers again"
    assert_same_result(plain.run(model.weights), tfs.run(model.weights))


def test_budget_plans_follow_the_batch_size(sessions):
    """In budget mode plans are keyed by the fed shapes: a small batch fits whole, a large one
    is partitioned; both give plain TensorFlow's results, step after step."""
    model = models.mlp(layers=4, width=64, features=64)
    fetches = [model.train, model.loss]
    # a budget between the large batch's smallest plan and its whole step
    whole = tfmem.TFMemSession(sessions(model.graph), partition_size=10**6,
                               options=tfmem.Options(swap_min_bytes=0))
    least = tfmem.TFMemSession(sessions(model.graph), partition_size=1, swap="all",
                               swap_distance=0, options=tfmem.Options(swap_min_bytes=0))
    low, high = (s.simulate(fetches, model.feed(LARGE)).peak_device for s in (least, whole))
    assert whole.simulate(fetches, model.feed(8)).peak_device < low < high
    budget = int((low + high) / 2 / (1 - _budget.DEFAULT_MARGIN))
    plain = sessions(model.graph)
    tfs = tfmem.TFMemSession(sessions(model.graph), device_memory_budget=budget,
                             options=tfmem.Options(swap_min_bytes=0))
    plain.run(model.init)
    tfs.run(model.init)
    small, large = tfs.plan(fetches, model.feed(8)), tfs.plan(fetches, model.feed(LARGE))
    assert len(small.partitions) == 1
    assert len(large.partitions) > 1
    check_plan(large, model.graph)
    for step in range(6):
        feed = model.feed(8 if step % 2 else LARGE, data_seed=step)
        exp = plain.run(fetches, feed_dict=feed)
        got = tfs.run(fetches, feed_dict=feed)
        np.testing.assert_allclose(got[1], exp[1], rtol=RTOL, atol=ATOL)
        assert tfs.plan(fetches, feed) is (large if step % 2 == 0 else small)
    assert tfs.host_buffers.in_use_bytes == 0


def _build_feedable():
    """A train step whose hidden layer `h` can be fed in place of computing it from x."""
    rs = np.random.RandomState(3)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        w1 = tf1.Variable(rs.standard_normal((6, 8)).astype(np.float32) * 0.5, name="w1")
        w2 = tf1.Variable(rs.standard_normal((8, 1)).astype(np.float32) * 0.5, name="w2")
        seen = tf1.Variable(0.0, name="seen")  # counts the steps that computed h from x
        with tf.control_dependencies([seen.assign_add(1.0)]):
            h = tf.tanh(tf.matmul(x, w1), name="h")
        y = h
        for i in range(4):
            y = tf.sin(y) + h * 0.5
        loss = tf.reduce_mean(tf.square(tf.matmul(y, w2)), name="loss")
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=[w2])  # w1 needs x
        init = tf1.global_variables_initializer()
    return g, x, h, loss, train, init, [w1, w2, seen], rs


@pytest.mark.parametrize("swap", ["all", "auto"])
def test_same_fetches_with_alternating_feeds(swap, sessions):
    """Feed the intermediate `h` one step and `x` the next: two plans, one state."""
    g, x, h, loss, train, init, state, rs = _build_feedable()
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=2, swap=swap,
                             options=tfmem.Options(swap_min_bytes=0))
    plain.run(init)
    tfs.run(init)
    fed_h = tfs.plan([train, loss], feed_dict={h: np.zeros((3, 8), np.float32)})
    fed_x = tfs.plan([train, loss], feed_dict={x: np.zeros((3, 6), np.float32)})
    assert fed_h is not fed_x
    assert "h" not in {op for p in fed_h.partitions for op in p.ops}
    assert "h" in {op for p in fed_x.partitions for op in p.ops}
    for step in range(6):
        feed = ({h: rs.uniform(-1, 1, (3, 8)).astype(np.float32)} if step % 2 else
                {x: rs.standard_normal((3, 6)).astype(np.float32)})
        assert_same_result(plain.run([train, loss], feed_dict=feed),
                           tfs.run([train, loss], feed_dict=feed))
        assert tfs.plan([train, loss], feed_dict=feed) is (fed_h if step % 2 else fed_x)
    assert_same_result(plain.run(state), tfs.run(state))
    assert tfs.run(state[2]) == 3.0  # h was computed from x in three steps of six


def test_graph_grows_between_training_steps(pair):
    """New heads (ops, a variable, its initializer and optimizer) appear while training."""
    model = build_mlp("momentum")
    plain, tfs = pair(model.graph, 3, model.init)
    requests = [[model.train, model.loss]]
    plans = {}
    for step in range(8):
        if step in (2, 5):  # the graph grows: a new head reading the trained weights
            with model.graph.as_default():
                scale = tf1.Variable(np.float32(0.5 + step), name=f"scale{step}")
                head = tf.reduce_sum(tf.tanh(model.weights[2] * scale)) + model.loss
                opt = tf1.train.GradientDescentOptimizer(0.05)
                head_train = opt.minimize(head, var_list=[scale])
                head_init = tf1.variables_initializer([scale])
            plain.run(head_init)
            tfs.run(head_init)
            requests.append([head_train, head, model.loss])
        feed = model.data[step % len(model.data)]
        for fetches in requests:
            assert_same_result(plain.run(fetches, feed_dict=feed), tfs.run(fetches, feed_dict=feed))
            plan = tfs.plan(fetches, feed_dict=feed)
            key = tuple(id(f) for f in fetches)
            # a request the growth did not reach keeps its plan
            assert plans.setdefault(key, plan) is plan
    assert len(plans) == 3
    assert_same_result(plain.run(model.weights), tfs.run(model.weights))
