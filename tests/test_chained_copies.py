"""Chained copies: each partition's copies run in the order the simulator counts.

TensorFlow's executor picks among ready ops by what it measured and by hash
orders, so one plan's peak can move from process to process
(docs/how-it-works.md, "The memory model").  TFMemSession chains each partition's copies in
its depth-first order (op_order.chained_order) and the simulator counts that
order only.  These tests check the order the step statistics show, with two
inter-op threads free to run ready ops at once, that results stay bit-equal to
plain TensorFlow, and the partitions that are not chained (an original, v1
control flow).
"""

import re

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.memory import op_order
from tfmem.memory.simulate import partition_orders
from tfmem.plan.analyse import analyse
from tfmem.run.compiling.rewrite import copy_chains

from conftest import assert_same_result, build_mlp, tfmem_config

tf1 = tf.compat.v1
_COPY = re.compile(r"^tfmem/plan(?:_\d+)?/p\d+/(.*)$")


def _branchy_graph():
    """Four independent branches joined at the end: an executor with two threads, or one
    that follows its own costs, runs them in any interleaving."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [64, 64], name="x")
        branches = []
        for b in range(4):
            h = x
            for i in range(5):
                h = tf.tanh(tf.matmul(h, h) * (0.01 * (b + 1)), name=f"b{b}_{i}")
            branches.append(h)
        out = tf.add_n(branches, name="out")
    return graph, x, out


@pytest.mark.parametrize("partition_size", [100000, 12])
def test_the_copies_run_in_the_simulated_order(partition_size, closed_at_teardown):
    """The step statistics show every partition's copies started in the chained order,
    the one order the simulator counts for them, and the values equal plain TensorFlow's."""
    graph, x, out = _branchy_graph()
    feed = {x: np.random.RandomState(0).uniform(-1, 1, (64, 64)).astype(np.float32)}
    plain, wrapped = closed_at_teardown(tf1.Session(graph=graph, config=tfmem_config()),
                                        tf1.Session(graph=graph, config=tfmem_config()))
    tfs = tfmem.TFMemSession(wrapped, partition_size=partition_size, swap="none")
    metadata = tf1.RunMetadata()
    got = tfs.run(out, feed, options=tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE),
                  run_metadata=metadata)
    assert_same_result(plain.run(out, feed), got)
    started = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            match = _COPY.match(node.node_name)
            if match:
                started[match.group(1)] = min(node.all_start_micros,
                                              started.get(match.group(1), float("inf")))
    plan = tfs.plan(out, feed)
    assert (len(plan.partitions) == 1) == (partition_size == 100000)
    for partition in plan.partitions:
        orders = list(partition_orders(plan.view, partition.ops, plan.view.originals))
        assert len(orders) == 1, "a chained partition has one order to simulate"
        ran = [op for op in orders[0] if op in started]
        assert len(ran) > len(partition.ops) // 2
        assert sorted(ran, key=started.__getitem__) == ran


def test_training_through_chained_copies_equals_plain(two_sessions):
    """An MLP trained at a small partition size, chained: bit-equal losses and weights."""
    m = build_mlp()
    plain, wrapped = two_sessions(m.graph)
    plain.run(m.init)
    wrapped.run(m.init)
    tfs = tfmem.TFMemSession(wrapped, partition_size=10, swap="none")
    for feed in m.data:
        assert_same_result(plain.run([m.train, m.loss], feed), tfs.run([m.train, m.loss], feed))
    plan = tfs.plan([m.train, m.loss], m.data[0])
    assert len(plan.partitions) > 1
    assert all(op_order.chained_order(plan.view, p.ops) for p in plan.partitions)
    assert_same_result(plain.run(m.weights), wrapped.run(m.weights))


@pytest.mark.parametrize("control_flow", ["v1"], indirect=True)
def test_originals_and_v1_loops_keep_the_executor_order(control_flow):
    """A partition holding an original that allocates (the user's random op) or a v1 loop
    is not chained: the executor orders it, and the simulator keeps counting the worst of
    its orders.  A variable's read, an original too, allocates nothing: it is left out of
    the chain and does not stop it."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        noise = tf1.random_uniform([4], seed=1, name="noise")
        looped = tf1.while_loop(lambda i, v: i < 3, lambda i, v: (i + 1, v * 2.0),
                                [tf.constant(0), x])[1]
        plain_sum = tf.reduce_sum(x * 3.0, name="plain_sum")
        weight = tf1.get_variable("w", initializer=np.ones(4, np.float32), use_resource=True)
        weighted = tf.reduce_sum(x * weight, name="weighted")
        fetches = [noise + x, looped, plain_sum, weighted]
    with graph.as_default():
        view = analyse(fetches, [], [x], chained=True)
        unchained = analyse(fetches, [], [x])
    loop_ops = [n for n, node in view.nodes.items() if node.type in ("Enter", "Exit")]
    assert loop_ops
    draw = [op for op in view.originals if view.nodes[op].type == "RandomUniform"]
    assert draw, "the random op must run as the user's op for this test"
    # (beside an op it does not feed: a draw and its one reader have one order only)
    assert list(partition_orders(view, draw + ["add"], view.originals)) == [draw + ["add"]]
    for ops in (draw + ["add", "mul"], loop_ops):
        assert op_order.chained_order(view, ops) is None
        assert len(list(partition_orders(view, ops, view.originals))) > 1
    simple = [op for op in view.nodes if op.startswith(("mul", "plain_sum"))]
    assert op_order.chained_order(view, simple) == op_order.dependency_order(view, simple)
    assert op_order.chained_order(unchained, simple) is None
    read = [op for op in view.originals if view.nodes[op].type == "ReadVariableOp"]
    assert len(read) == 1
    with_read = read + [op for op in view.nodes if op.startswith(("mul_1", "weighted"))]
    assert op_order.chained_order(view, with_read) is not None
    assert copy_chains(view, [with_read]) == [
        [op for op in op_order.dependency_order(view, with_read) if op != read[0]]]


def test_budget_mode_leaves_the_order_to_the_executor(two_sessions):
    """Budget mode plans with the worst of the executor's orders and kernels at once, the
    bound its experiments validated, and does not chain: fitted to the chained order
    alone, ResNet's quick search runs out of memory at a cap (docs/how-it-works.md, The memory
    model)."""
    m = build_mlp()
    plain, wrapped = two_sessions(m.graph)
    plain.run(m.init)
    wrapped.run(m.init)
    fixed = tfmem.TFMemSession(wrapped, partition_size=10)
    budgeted = tfmem.TFMemSession(wrapped, device_memory_budget="1GiB")
    feed = m.data[0]
    assert fixed.plan([m.train, m.loss], feed).view.chained
    assert not budgeted.plan([m.train, m.loss], feed).view.chained
    assert_same_result(plain.run([m.train, m.loss], feed), budgeted.run([m.train, m.loss], feed))


def _waits_for_delete(op):
    """Whether `op` waits for a DeleteSessionTensor: directly, or through the gate constant
    a per-partition import maps a control edge to (rewrite.rewrite_partition)."""
    for control in op.control_inputs:
        if control.type == "DeleteSessionTensor" or any(
                c.type == "DeleteSessionTensor" for c in control.control_inputs):
            return True
    return False


@pytest.mark.parametrize("writer", ["whole plan", "partial run", "per partition"])
def test_a_freed_input_is_deleted_before_its_last_reader(writer, two_sessions):
    """A tensor swapped out and uploaded for the next partition is read there last by a
    sine: the copy of the sine waits for the upload's deleter, so it holds the only
    reference and TensorFlow may write the sine into the tensor's buffer (the simulator
    counts it: test_memory_model).  Every copy writer adds the edge; values stay
    bit-equal."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 64], name="x")
        kept = tf.tanh(x, name="kept")
        out = tf.reduce_sum(tf.sin(kept, name="last_reader") * 2.0)
    plain, wrapped = two_sessions(graph)
    tfs = tfmem.TFMemSession(wrapped, partition_size=1, swap="all",
                             options=tfmem.Options(swap_min_bytes=0,
                                                   partial_runs=writer == "partial run",
                                                   one_import=writer != "per partition",
                                                   measure="off"))
    feed = {x: np.random.RandomState(0).uniform(-1, 1, (32, 64)).astype(np.float32)}
    for _ in range(2):
        assert_same_result(plain.run(out, feed), tfs.run(out, feed))
    assert tfs.last_step.partial_run == (writer == "partial run")
    plan = tfs.plan(out, feed)
    assert plan.transfer("kept:0").swapped
    readers = [op for op in tfs.session.graph.get_operations()
               if op.type == "Sin" and op.name.startswith("tfmem/")]
    assert readers and all(_waits_for_delete(op) for op in readers), \
        [(op.name, [c.name for c in op.control_inputs]) for op in readers]
