"""tfmem.Session runs a session graph of its own: a copy of what requests reach.

The copy must hold everything a request needs (inputs, control edges,
colocation, shapes set in Python, functions), nothing it does not, keep the
user's graph unchanged, and give the numbers of a plain session of the user's
graph.  Helpers TensorFlow drives through a session (savers, queue runners,
partial runs) and control flow run on both kinds of session in
test_session_interface.py and test_control_flow.py.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import tfmem_config
from tfmem.cli import models

tf1 = tf.compat.v1


def _filled_mlp(filler_ops):
    """An MLP whose graph also holds a chain of `filler_ops` ops no request reads."""
    model = models.mlp(layers=4, width=16, features=16)
    with model.graph.as_default():
        with tf.name_scope("filler"):
            h = tf.constant(np.ones((4, 4), np.float32))
            for _ in range(filler_ops // 2):
                h = tf.tanh(h) * 0.5
    return model


@pytest.fixture
def own_and_plain(closed_at_teardown):
    """Factory: ``make(graph)`` -> (tfmem.Session at partition_size 6, plain session),
    both with tfmem_config() and closed at teardown."""
    return lambda graph: closed_at_teardown(
        tfmem.Session(graph=graph, config=tfmem_config(), partition_size=6),
        tf1.Session(graph=graph, config=tfmem_config()))


def _both_initialised(own_and_plain, graph, init):
    """(tfmem.Session, plain session) of `graph`, `init` run in both."""
    tfs, plain = own_and_plain(graph)
    tfs.run(init)
    plain.run(init)
    return tfs, plain


def _initialised(own_and_plain, model):
    """(model, tfmem.Session, plain session), the model's variables initialised in both."""
    return (model, *_both_initialised(own_and_plain, model.graph, model.init))


def test_unrelated_ops_stay_out_and_the_users_graph_is_unchanged(own_and_plain):
    model = _filled_mlp(400)
    fetches = [model.train, model.loss]
    before = model.graph.version
    model, tfs, plain = _initialised(own_and_plain, model)
    compiles = []
    for batch in (8, 8, 5):
        feed = model.feed(batch, data_seed=batch)
        np.testing.assert_array_equal(tfs.run(fetches, feed)[1], plain.run(fetches, feed)[1])
        compiles.append(tfs.last_compile)
    # the first step copied the training request into the session graph, and says so
    assert compiles[0].copy_time > 0 and "copying into the session graph" in str(compiles[0])
    assert tfs.last_step.partitions > 1
    assert tfs.graph is model.graph and model.graph.version == before
    copied = {op.name for op in tfs.session.graph.get_operations()}
    assert not any(name.startswith("filler/") for name in copied)
    users = {op.name for op in model.graph.get_operations()}
    request = tfs.plan(fetches, model.feed(8)).view.nodes
    assert set(request) <= copied and set(request) <= users


def test_ops_added_after_the_first_run_see_the_same_state(own_and_plain):
    model, tfs, plain = _initialised(own_and_plain, _filled_mlp(10))
    feed = model.feed(8)
    for _ in range(2):
        tfs.run(model.train, feed)
        plain.run(model.train, feed)
    with model.graph.as_default():
        variables = tf1.global_variables()
        total = tf.add_n([tf.reduce_sum(v) for v in variables])
    assert tfs.run(total) == plain.run(total)
    for got, expected in zip(tfs.run(variables), plain.run(variables)):
        np.testing.assert_array_equal(got, expected)


def test_shapes_set_in_python_reach_the_copy(own_and_plain):
    """`set_shape` lives in the graph, not in the NodeDef the copy is made from."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None], name="x")
        flat = tf.reshape(x, [-1, 3])
        flat.set_shape([4, 3])
        y = tf.reduce_sum(tf.tanh(flat) * 2.0, axis=1)
    tfs, plain = own_and_plain(g)
    feed = {x: np.arange(12, dtype=np.float32)}
    np.testing.assert_array_equal(tfs.run(y, feed), plain.run(y, feed))
    assert tfs.session.graph.get_tensor_by_name(flat.name).shape == [4, 3]


def test_an_op_named_as_the_scope_of_a_copied_op(own_and_plain):
    """"a" after "a/c" was copied: TensorFlow's importer refuses such a name once the
    scope is in the graph, so the copy takes "a" with "a/c"."""
    g = tf.Graph()
    with g.as_default():
        with tf.name_scope("a") as scope:
            inner = tf.constant(1.5, name="c")
            outer = tf.identity(inner * 2.0, name=scope)
    assert outer.op.name == "a"
    tfs, plain = own_and_plain(g)
    assert tfs.run(inner) == plain.run(inner)
    assert tfs.run(outer) == plain.run(outer) == 3.0


def test_functions_and_their_gradients_are_copied(own_and_plain):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 3], name="x")
        w = tf1.Variable(np.full((3, 3), 0.3, np.float32), name="w")

        @tf.function
        def block(h):
            return tf.tanh(tf.matmul(h, w)) + h

        h = x
        for _ in range(3):
            h = block(h)
        loss = tf.reduce_sum(h * h)
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    tfs, plain = _both_initialised(own_and_plain, g, init)
    feed = {x: np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)}
    for _ in range(2):
        np.testing.assert_array_equal(tfs.run([train, loss], feed)[1],
                                      plain.run([train, loss], feed)[1])


def test_ops_sharing_many_control_inputs_wait_on_them_through_one_op(own_and_plain):
    """`with control_dependencies(update_ops): minimize(loss)` gives every gradient op a
    control edge from every update: the copy writes each shared set once, and the
    updates still run with the step (the moving averages equal the plain session's)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [8, 6], name="x")
        h, averages = x, []
        for layer in range(12):
            w = tf1.get_variable(f"w{layer}", [6, 6],
                                 initializer=tf1.glorot_uniform_initializer(seed=layer))
            h = tf.tanh(tf.matmul(h, w))
            average = tf1.get_variable(f"average{layer}", [],
                                       initializer=tf1.zeros_initializer())
            averages.append(average)
            tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS, average.assign(
                0.9 * average + 0.1 * tf.reduce_mean(h)))
        loss = tf.reduce_sum(h * h)
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train = tf1.train.GradientDescentOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    tfs, plain = _both_initialised(own_and_plain, g, init)
    feed = {x: np.linspace(-1, 1, 48, dtype=np.float32).reshape(8, 6)}
    for _ in range(3):
        tfs.run(train, feed)
        plain.run(train, feed)
    for got, expected in zip(tfs.run(averages), plain.run(averages)):
        assert got == expected != 0.0

    def control_edges(graph, of):
        return sum(len(op.control_inputs) for op in graph.get_operations() if op.name in of)

    users = {op.name for op in g.get_operations()}
    copied = users & {op.name for op in tfs.session.graph.get_operations()}
    assert control_edges(g, copied) > 250
    assert control_edges(tfs.session.graph, copied) < control_edges(g, copied) / 5


def test_a_user_op_with_the_name_of_tfmems_own_is_refused_clearly(own_and_plain):
    model, tfs, plain = _initialised(own_and_plain, _filled_mlp(10))
    feed = model.feed(8)
    tfs.run(model.loss, feed)
    taken = next(op.name for op in tfs.session.graph.get_operations()
                 if op.name.startswith("tfmem/"))
    with model.graph.as_default():
        clash = tf.identity(model.loss, name=taken)
    assert clash.op.name == taken
    with pytest.raises(ValueError, match="rename the op"):
        tfs.run(clash, feed)
    # the session is not damaged: the same state, the same numbers
    np.testing.assert_array_equal(tfs.run([model.train, model.loss], feed)[1],
                                  plain.run([model.train, model.loss], feed)[1])
