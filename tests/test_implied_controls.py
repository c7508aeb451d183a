"""Analysis drops control edges another path implies, and the step runs the same.

Under `control_dependencies(updates)` every op created in the block waits for every
update, though most of them already wait for one that does.  The planners walk each
edge for every candidate plan, so the view keeps only the edges no other path gives.
"""

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.plan.analyse import analyse

tf1 = tf.compat.v1


def _graph():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        counters = [tf1.get_variable(f"c{i}", [], initializer=tf1.zeros_initializer(),
                                     use_resource=True) for i in range(3)]
        updates = [tf1.assign_add(c, 1.0, name=f"update{i}") for i, c in enumerate(counters)]
        # one block per op, as layers written one at a time under the updates make them
        # (TensorFlow leaves out only the edges that an input of the same block implies)
        with tf.control_dependencies(updates):
            a = tf.multiply(x, 2.0, name="a")
        with tf.control_dependencies(updates):
            b = tf.cos(a, name="b")
        with tf.control_dependencies(updates):
            c = tf.sin(b, name="c")
        with tf.control_dependencies(updates):
            d = tf.add(c, x, name="d")  # reads x too: still waits, through c
        init = tf1.global_variables_initializer()
    return graph, x, d, counters, init, {u.op.name for u in updates}


def test_edges_another_path_implies_are_dropped():
    _, x, d, _, _, updates = _graph()
    view = analyse([d], [], [x])
    graph_b = d.graph.get_operation_by_name("b")
    assert updates <= {c.name for c in graph_b.control_inputs}  # in the graph
    keeping = [node for node in view.nodes.values() if updates & set(node.control_inputs)]
    # only ops that read nothing else of the step (its constants, a) keep them
    assert keeping and all(node.name == "a" or not node.inputs for node in keeping)
    for name in ("b", "c", "d"):
        assert set(view.nodes[name].control_inputs).isdisjoint(updates), name
    # every op still runs after every update, by some path
    for name in ("a", "b", "c", "d"):
        assert updates <= _ancestors(view, name), name


def _ancestors(view, name):
    seen, stack = set(), [name]
    while stack:
        node = view.nodes.get(stack.pop())
        if node is None:
            continue
        for producer in node.producers:
            if producer not in seen:
                seen.add(producer)
                stack.append(producer)
    return seen


def test_a_step_without_the_implied_edges_runs_as_plain_tensorflow():
    values = np.arange(4, dtype=np.float32)
    results = []
    for wrap in (False, True):
        graph, x, d, counters, init, _ = _graph()
        with tf1.Session(graph=graph) as sess:
            sess.run(init)
            runner = tfmem.TFMemSession(sess, partition_size=1) if wrap else sess
            out = [runner.run(d, feed_dict={x: values}) for _ in range(3)]
            results.append((out, sess.run(counters)))
    (plain, plain_counters), (partitioned, counts) = results
    np.testing.assert_array_equal(np.array(plain), np.array(partitioned))
    assert plain_counters == counts == [3.0, 3.0, 3.0]  # each update once per step
