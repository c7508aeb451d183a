"""The same graph gives the same plan, however TensorFlow lists an op's control inputs.

TensorFlow returns control inputs in the order of its in-edge set, which follows
memory addresses: the same graph built twice lists a `tf.group`'s inputs in a
different order.  The plan (and so its prediction, and the copies TensorFlow runs)
must not follow that order.
"""

import tensorflow as tf

import tfmem


def _training_step():
    """24 small layers whose updates one `tf.group` joins (as an optimizer's step does)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8], name="x")
        h, updates = x, []
        for i in range(24):
            w = tf.compat.v1.get_variable(f"w{i}", [8, 8])
            h = tf.tanh(tf.matmul(h, w))
            updates.append(tf.compat.v1.assign_sub(w, 0.01 * w).op)
        step = tf.group(*updates, name="step")
    return graph, x, h, step


def _plan_of(build):
    graph, x, h, step = build()
    with tf.compat.v1.Session(graph=graph) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=20)
        plan = tfs.plan([h, step], {x: [[0.0] * 8] * 4})
        return tuple(tuple(p.ops) for p in plan.partitions)


def test_the_same_graph_gives_the_same_plan_whatever_order_tensorflow_lists_control_inputs(
        monkeypatch):
    listed = tf.Operation.control_inputs  # TensorFlow's property
    plans = {_plan_of(_training_step)}
    for reorder in (lambda ops: ops[::-1], lambda ops: ops[1::2] + ops[::2]):
        # what another process (another set of edge addresses) may list
        monkeypatch.setattr(tf.Operation, "control_inputs",
                            property(lambda op, r=reorder: r(list(listed.fget(op)))))
        plans.add(_plan_of(_training_step))
    monkeypatch.undo()
    for _ in range(4):  # and TensorFlow's own orders, which differ between builds
        plans.add(_plan_of(_training_step))
    assert len(plans) == 1
