"""Sizing's reads of op attributes and constant inputs, shared between ops that repeat them.

The dedup signatures, the kernel keys and the kernel inputs' values are each checked
against what TensorFlow itself holds for every op: its NodeDef's attributes and
`tf.get_static_value`, for ops that share attribute sets and values and ops that
differ from them in one attribute, device or value.
"""

import numpy as np
import tensorflow as tf

from tfmem import tf_private
from tfmem.memory import dedup, scratch
from tfmem.memory.shapes import import_request
from tfmem.plan.analyse import analyse

tf1 = tf.compat.v1


def _graph():
    """Three convolutions of one input (two alike, one strided), one more on another
    device, and sums over constant axes (two constants of one value, one of another)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
        w = tf.constant(np.ones((3, 3, 3, 4), np.float32), name="w")
        convs = [tf.nn.conv2d(x, w, 1, "SAME", name="a"), tf.nn.conv2d(x, w, 1, "SAME", name="b"),
                 tf.nn.conv2d(x, w, 2, "SAME", name="strided")]
        with tf.device("/cpu:0"):
            convs.append(tf.nn.conv2d(x, w, 1, "SAME", name="placed"))
        axes = [tf.constant([1, 2], name="axes_a"), tf.constant([1, 2], name="axes_b"),
                tf.constant([0, 3], name="axes_c")]
        sums = [tf.reduce_sum(c, axes[i % 3], name=f"sum{i}") for i, c in enumerate(convs)]
        # inputs whose values shape inference knows at the fed shape (x's), and does not
        sums.append(tf.broadcast_to(tf.constant(1.0), tf.shape(x), name="broadcast"))
        sums.append(tf.raw_ops.BroadcastGradientArgs(s0=tf.shape(x), s1=[3], name="args")[0])
    return graph, x, sums


def _attributes(op, keep):
    """The attributes of `op` as TensorFlow's NodeDef has them, serialized, sorted."""
    return tuple(sorted((key, value.SerializeToString(deterministic=True))
                        for key, value in op.node_def.attr.items() if keep(key)))


def test_signatures_are_each_ops_node_def_attributes():
    graph, x, sums = _graph()
    view = analyse(sums, [], [x])
    signatures = dedup.signatures(graph, view)
    assert {"a", "b", "strided", "placed", "axes_a", "axes_c"} <= signatures.keys()
    for name, signature in signatures.items():
        op = graph.get_operation_by_name(name)
        assert signature == (op.type, op.device, _attributes(op, lambda key: key != "_class"))
    assert signatures["a"] == signatures["b"]
    assert signatures["strided"] != signatures["a"] != signatures["placed"]
    assert signatures["axes_a"] == signatures["axes_b"] != signatures["axes_c"]


def test_kernel_attributes_and_constant_inputs_are_each_ops_own():
    graph, x, sums = _graph()
    view = analyse(sums, [], [x])
    copy = import_request(graph, view, {x.name: (2, 8, 8, 3)})
    memo, constants = {}, {}
    known = []
    for name in ["a", "b", "strided", "placed", "sum0", "sum1", "sum2", "sum3", "broadcast",
                 "args"]:
        op = copy.get_operation_by_name("s/" + name)
        attrs = dedup.node_attrs(tf_private.serialized_node_def(op), memo)
        assert scratch.kernel_attrs(attrs) == tuple(
            (key, value.hex()) for key, value in _attributes(op, lambda k: not k.startswith("_")))
        for tensor in op.inputs:
            spec = scratch.input_spec(tensor, constants)
            value = tf.get_static_value(tensor) if tensor.dtype.is_integer else None
            assert spec[2] == (None if value is None else value.tolist())
            known.append(spec[2])
    assert len(memo) < 10 and len(constants) == 3  # shared where equal, apart where not
    assert [2, 8, 8, 3] in known  # the fed shape, read off the copy's Shape


def test_alike_ops_share_one_attribute_set_whatever_order_tensorflow_serialized_them_in():
    """TensorFlow serializes a NodeDef's attribute map in an order of its own choosing,
    which differs between identical ops of one graph."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
        w = tf.constant(np.ones((3, 3, 3, 4), np.float32), name="w")
        convs = [tf.nn.conv2d(x, w, 1, "SAME") for _ in range(200)]
    memo = {}
    for conv in convs:
        dedup.node_attrs(tf_private.serialized_node_def(conv.op), memo)
    assert len(memo) == 1
