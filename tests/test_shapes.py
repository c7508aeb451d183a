"""Shapes: a request's tensors at the fed shapes, read from a copy of its ops.

Each resolved shape is checked against the value plain TensorFlow computes at those
shapes; the copy must import whatever the request's ops name outside it (a control
edge from a fed placeholder, a colocation with an op the request does not need).
"""

import numpy as np
import pytest
import tensorflow as tf

from tfmem.memory.shapes import import_request, resolve_shapes
from tfmem.plan.analyse import analyse

tf1 = tf.compat.v1


def _graph():
    """x [?, 3] -> h = x @ w (colocated with an op outside the request) -> s = sum(h)
    under a control edge from the fed placeholder `gate`; `grown` has a batch of twice
    x's (a shape inference must run, not a copy of static shapes)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        gate = tf1.placeholder(tf.float32, [], name="gate")
        w = tf.constant(np.ones((3, 5), np.float32), name="w")
        outside = tf.identity(w, name="outside")  # not needed by the fetches
        with graph.colocate_with(outside.op):
            h = tf.matmul(x, w, name="h")
        with tf.control_dependencies([gate.op]):
            s = tf.reduce_sum(h, axis=1, name="s")
        grown = tf.concat([h, h], axis=0, name="grown")
    return graph, x, gate, [s, grown]


@pytest.mark.parametrize("batch", [1, 7])
def test_resolved_shapes_are_the_shapes_tensorflow_computes(batch):
    graph, x, gate, fetches = _graph()
    view = analyse(fetches, [], [x, gate])
    assert "outside" not in view.nodes and "gate" not in view.nodes  # named, not needed
    shapes = resolve_shapes(graph, view, {x.name: (batch, 3), gate.name: ()})
    with tf1.Session(graph=graph) as session:
        values = session.run({t.name: t for t in fetches + [graph.get_tensor_by_name("h:0")]},
                             {x: np.zeros((batch, 3), np.float32), gate: 1.0})
    assert values and all(shapes[name] == value.shape for name, value in values.items())
    assert shapes["grown:0"] == (2 * batch, 5)


def test_the_copy_keeps_the_control_edges_inside_the_request():
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        first = tf.square(x, name="first")
        with tf.control_dependencies([first.op]):
            second = tf.negative(x, name="second")
        fetch = tf.add(first, second, name="sum")
    view = analyse([fetch], [], [x])
    copy = import_request(graph, view, {x.name: (4, 2)})
    assert [op.name for op in copy.get_operation_by_name("s/second").control_inputs] == \
        ["s/first"]
    assert copy.get_tensor_by_name("s/sum:0").shape.as_list() == [4, 2]
