"""tfmem never changes an op of the user's: not an input, not a device, not an attribute.

Every op of the user's graph is recorded (its NodeDef, device, output shapes,
control inputs, colocation groups) before tfmem plans anything and compared
after it has planned and run training steps; meanwhile every call of
TensorFlow's methods that change an op is recorded when it changes one of the
user's (setting an attribute to the value it has already changes nothing in
the NodeDef, but TensorFlow warns of it, and will refuse it, after the op has
run).  Both front ends:
TFMemSession (a TF1 graph whose initialisers, random draws and control edges
become originals that tfmem's copies wait for, through each way plans are
imported: one import per plan, one per partition, partial runs) and
tfmem.function (the traced graph of a training step).
`Graph.control_dependencies([op])` alone would set
`_has_manual_control_dependencies` on `op`.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

import tfmem
from conftest import new_session

tf1 = tf.compat.v1


def _snapshot(ops):
    """{op name: everything of the op a change would show in}."""
    return {op.name: (op.node_def.SerializeToString(deterministic=True), op.device,
                      tuple(str(t.shape) for t in op.outputs),
                      tuple(c.name for c in op.control_inputs),
                      tuple(op.colocation_groups()))
            for op in ops}


def _changed(before, graph_ops):
    after = _snapshot(op for op in graph_ops if op.name in before)
    return sorted(name for name in before if after.get(name) != before[name])


# TensorFlow's methods that change an existing op
MUTATIONS = ("_set_attr", "_set_attr_with_buf", "_clear_attr", "_set_func_attr",
             "_set_func_list_attr", "_set_type_list_attr", "_set_shape_list_attr",
             "_set_device", "_set_device_from_string", "_update_input", "_add_control_input",
             "_add_control_inputs", "_remove_all_control_inputs", "_add_while_inputs",
             "_add_outputs", "_set_control_flow_context")


@pytest.fixture
def mutations(monkeypatch):
    """watch(graph): from now on, record [(op name, method)] of each change of an op the
    graph holds now; returns that list."""
    def watch(graph):
        users = {id(op) for op in graph.get_operations()}
        changes = []
        for name in MUTATIONS:
            original = getattr(ops.Operation, name)

            def spy(op, *args, _original=original, _name=name, **kwargs):
                if id(op) in users:
                    changes.append((op.name, _name))
                return _original(op, *args, **kwargs)
            monkeypatch.setattr(ops.Operation, name, spy)
        return changes
    return watch


def _tf1_model(resource_only=False):
    """A training step whose initialisers are originals that the init NoOp's copy waits
    for; unless `resource_only`, also with reference variables and a seeded random draw
    (originals of another kind, which partial runs do not take)."""
    rs = np.random.RandomState(0)
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [8, 6], name="x")
        counter = tf1.Variable(0, dtype=tf.int64, name="counter", use_resource=resource_only)
        count = counter.assign_add(1)
        h = x
        for i in range(3):
            w = tf1.Variable((rs.standard_normal((6, 6)) * 0.3).astype(np.float32),
                             name=f"w{i}", use_resource=resource_only or i != 1)
            h = tf.tanh(tf.matmul(h, w))
        if not resource_only:
            h = tf1.nn.dropout(h, rate=0.25, seed=3)  # a seeded random draw: an original
        with tf.control_dependencies([count]):  # the user's own control edge
            h = tf.identity(h)
        loss = tf.reduce_mean(h * h, name="loss")
        train = tf1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return graph, x, loss, train, init


@pytest.mark.parametrize("route", ["plan_import", "per_partition", "partial_runs"])
def test_tfmem_session_changes_no_user_op(route, mutations):
    graph, x, loss, train, init = _tf1_model(resource_only=(route == "partial_runs"))
    before = _snapshot(graph.get_operations())
    changes = mutations(graph)
    sess = new_session(graph)
    sess.run(init)  # the user's ops have run: a change now would be lost, and warned of
    tfs = tfmem.TFMemSession(sess, partition_size=3,
                             options=tfmem.Options(partial_runs=(route == "partial_runs"),
                                                   one_import=(route != "per_partition"),
                                                   # measured steps run callables
                                                   measure=("off" if route == "partial_runs"
                                                            else "sample")))
    tfs.run(init)  # the initialisers are originals the init NoOp's copy waits for
    feed = {x: np.ones((8, 6), np.float32)}
    for _ in range(2):
        tfs.run([train, loss], feed)
    assert tfs.last_step.partitions > 1
    assert tfs.last_step.partial_run == (route == "partial_runs")
    assert _changed(before, graph.get_operations()) == []
    assert changes == []
    sess.close()


def test_tfmem_function_changes_no_op_of_the_traced_step(mutations):
    w = tf.Variable(np.linspace(-1, 1, 36, dtype=np.float32).reshape(6, 6))
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for _ in range(4):
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_mean(h * h)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    wrapped = tfmem.function(step, partition_size=3)
    x = tf.ones((8, 6))
    wrapped(x)  # builds the optimizer's slots (the first trace)
    graph = wrapped.get_concrete_function(x).graph
    before = _snapshot(graph.get_operations())
    changes = mutations(graph)
    for _ in range(2):
        wrapped(x)
    assert wrapped.last_step.partitions > 1
    assert _changed(before, graph.get_operations()) == []
    assert changes == []
