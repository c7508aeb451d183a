"""tf.while_loop and tf.cond, with v2 (default) and v1 control flow.

The ``control_flow`` fixture (conftest) builds each graph once with v2 and
once with ``tf.compat.v1.disable_control_flow_v2()`` active, and restores the
global toggle afterwards.  ``both_pairs`` runs each through a wrapped session and
through `tfmem.Session`, whose session graph copies what requests reach (v2 loops:
the function library; v1 loops: the frames' cycles).
"""

import numpy as np
import pytest
import tensorflow as tf

from conftest import RTOL, ATOL, assert_same_result, check_plan, op_types

tf1 = tf.compat.v1

V1_LOOP = {"Enter", "Exit", "NextIteration", "LoopCond"}
V1_COND = {"Switch", "Merge"}


def _assert_version(graph, version, v1_ops, v2_ops):
    types_ = op_types(graph)
    if version == "v1":
        assert v1_ops <= types_, f"expected v1 control flow ops {v1_ops} in {types_}"
        assert not (v2_ops & types_)
    else:
        assert v2_ops & types_, f"expected one of {v2_ops} in {types_}"
        assert not (v1_ops & types_)


def _chain(t, n, name):
    for i in range(n):
        t = tf.add(t * 0.9, 0.1, name=f"{name}{i}")
    return t


def _build_loop_model(seed=0):
    rs = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [3], name="x")
        w = tf1.Variable(rs.uniform(0.5, 1.0, 3).astype(np.float32), use_resource=True, name="w")
        pre = _chain(x, 4, "pre")

        def body(i, acc):
            return i + 1, tf.tanh(acc * w + pre)

        _, acc = tf.while_loop(lambda i, acc: i < 5, body, [tf.constant(0), pre])
        out = _chain(acc, 4, "post")
        loss = tf.reduce_sum(out * out, name="loss")
        grads = tf.gradients(loss, [w, x])
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    feed = {x: rs.standard_normal(3).astype(np.float32)}
    return g, x, w, out, loss, grads, train, init, feed


@pytest.mark.parametrize("partition_size", [1, 3, 7])
def test_while_loop_forward(control_flow, partition_size, both_pairs):
    g, x, w, out, loss, grads, train, init, feed = _build_loop_model()
    _assert_version(g, control_flow, V1_LOOP, {"While", "StatelessWhile"})
    plain, tfs = both_pairs(g, partition_size, init)
    plan = tfs.plan([out, loss], feed_dict=feed)
    assert len(plan.partitions) > 1
    check_plan(plan, g, partition_size, strict_size=False)
    assert_same_result(plain.run([out, loss], feed_dict=feed), tfs.run([out, loss], feed_dict=feed))


@pytest.mark.parametrize("partition_size", [1, 4])
def test_while_loop_gradients_and_training(control_flow, partition_size, both_pairs):
    g, x, w, out, loss, grads, train, init, feed = _build_loop_model()
    if control_flow == "v1":
        # gradients of a v1 while_loop use per-step stacks
        assert {"StackV2", "StackPushV2", "StackPopV2"} <= op_types(g)
    plain, tfs = both_pairs(g, partition_size, init)
    plan = tfs.plan(grads, feed_dict=feed)
    assert len(plan.partitions) > 1
    check_plan(plan, g, partition_size, strict_size=False)
    assert_same_result(plain.run(grads, feed_dict=feed), tfs.run(grads, feed_dict=feed))
    exp = [plain.run([train, loss], feed_dict=feed)[1] for _ in range(3)]
    got = [tfs.run([train, loss], feed_dict=feed)[1] for _ in range(3)]
    np.testing.assert_allclose(got, exp, rtol=RTOL, atol=ATOL)
    assert not np.allclose(exp[0], exp[-1])
    assert_same_result(plain.run(w), tfs.run(w))


def _build_cond_model(seed=0):
    rs = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [3], name="x")
        pred = tf1.placeholder(tf.bool, [], name="pred")
        w = tf1.Variable(rs.uniform(0.5, 1.5, 3).astype(np.float32), use_resource=True, name="w")
        pre = _chain(x, 3, "pre")
        c = tf.cond(pred, lambda: _chain(pre * w, 3, "t"), lambda: tf.sin(pre) - w)
        out = _chain(c, 3, "post")
        loss = tf.reduce_sum(out * out, name="loss")
        grads = tf.gradients(loss, [w, x])
        init = tf1.global_variables_initializer()
    return g, x, pred, w, out, loss, grads, init, rs.standard_normal(3).astype(np.float32)


@pytest.mark.parametrize("partition_size", [1, 3, 7])
def test_cond_forward_and_gradients(control_flow, partition_size, both_pairs):
    g, x, pred, w, out, loss, grads, init, xv = _build_cond_model()
    _assert_version(g, control_flow, V1_COND, {"If", "StatelessIf"})
    plain, tfs = both_pairs(g, partition_size, init)
    for p in (True, False):
        feed = {x: xv, pred: p}
        plan = tfs.plan([out, loss] + grads, feed_dict=feed)
        assert len(plan.partitions) > 1
        check_plan(plan, g, partition_size, strict_size=False)
        exp = plain.run([out, loss] + grads, feed_dict=feed)
        got = tfs.run([out, loss] + grads, feed_dict=feed)
        assert_same_result(exp, got)


def test_cond_only_taken_branch_updates_state(control_flow, both_pairs):
    g = tf.Graph()
    with g.as_default():
        pred = tf1.placeholder(tf.bool, [], name="pred")
        hits = tf1.Variable([0.0, 0.0], use_resource=True, name="hits")
        x = _chain(tf.constant([1.0, 2.0]), 3, "pre")

        def yes():
            with tf.control_dependencies([hits.assign_add([1.0, 0.0])]):
                return tf.identity(x * 2.0)

        def no():
            with tf.control_dependencies([hits.assign_add([0.0, 1.0])]):
                return tf.identity(x - 1.0)

        out = _chain(tf.cond(pred, yes, no), 3, "post")
        init = tf1.global_variables_initializer()
    plain, tfs = both_pairs(g, 2, init)
    assert len(tfs.plan(out, feed_dict={pred: True}).partitions) > 1
    for p in (True, True, False, True, False):
        assert_same_result(plain.run(out, feed_dict={pred: p}), tfs.run(out, feed_dict={pred: p}))
    exp_hits = plain.run(hits)
    np.testing.assert_array_equal(exp_hits, [3.0, 2.0])
    assert_same_result(exp_hits, tfs.run(hits))


@pytest.mark.parametrize("partition_size", [1, 5])
def test_tensor_array_in_while_loop(control_flow, partition_size, both_pairs):
    """v1: TensorArrayV3 is a per-step resource; everything touching it runs together."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        pre = _chain(x, 3, "pre")
        ta = tf.TensorArray(tf.float32, size=4)

        def body(i, ta):
            return i + 1, ta.write(i, pre[i] * tf.cast(i + 1, tf.float32))

        _, ta = tf.while_loop(lambda i, ta: i < 4, body, [0, ta])
        stacked = ta.stack()
        out = _chain(stacked, 3, "post")
        loss = tf.reduce_sum(out * out)
        grad = tf.gradients(loss, x)[0]
    if control_flow == "v1":
        assert "TensorArrayV3" in op_types(g)
    plain, tfs = both_pairs(g, partition_size)
    feed = {x: np.array([0.5, -1.0, 2.0, 0.25], np.float32)}
    plan = tfs.plan([out, grad], feed_dict=feed)
    assert len(plan.partitions) > 1
    check_plan(plan, g, partition_size, strict_size=False)
    assert_same_result(plain.run([out, grad], feed_dict=feed), tfs.run([out, grad], feed_dict=feed))


def test_cond_inside_while_loop(control_flow, both_pairs):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2], name="x")
        pre = _chain(x, 2, "pre")

        def body(i, acc):
            acc = tf.cond(tf.equal(i % 2, 0), lambda: acc * 2.0, lambda: acc - 1.0)
            return i + 1, acc

        _, acc = tf.while_loop(lambda i, acc: i < 6, body, [0, pre])
        out = _chain(acc, 3, "post")
        grad = tf.gradients(tf.reduce_sum(out), x)[0]
    plain, tfs = both_pairs(g, 2)
    feed = {x: np.array([0.3, -0.7], np.float32)}
    assert len(tfs.plan([out, grad], feed_dict=feed).partitions) > 1
    assert_same_result(plain.run([out, grad], feed_dict=feed), tfs.run([out, grad], feed_dict=feed))
