"""Shapes: every tensor of a request with its unknown dimensions resolved from feed shapes.

Graphs usually leave the batch (and sequence) dimension unknown.  Given the
shapes of the fed tensors, TensorFlow's own shape inference fills them in:
the request's ops are imported into a scratch graph with each fed tensor
replaced by a placeholder of the concrete shape, and the inferred output
shapes are read back.  Nothing runs, and the user's graph is not touched.
"""

import tensorflow as tf
from tensorflow.python.ops import handle_data_util

from tfmem import tf_private
from tfmem.plan.analyse import split_tensor_name


def import_request(graph, view, feed_shapes):
    """A scratch graph holding a copy of the request's ops under the prefix "s/", each fed
    tensor replaced by a placeholder of its shape in `feed_shapes` (when given).

    Shape inference runs as the copies are imported; nothing runs, and the user's
    graph is not touched.  `scratch.calibrate` reads concrete input shapes and
    constant shape vectors from it.
    """
    members = set(view.nodes) | set(view.sources)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    if tf_private.has_functions(graph):  # else serialising the graph finds no library
        graph_def.library.CopyFrom(graph.as_graph_def().library)
    ops = tf_private.ops_by_name(graph)
    for name in members:
        node = graph_def.node.add()
        node.CopyFrom(ops[name].node_def)
        kept = [i for i in node.input if (i[1:] if i.startswith("^") else
                                          split_tensor_name(i if ":" in i else i + ":0")[0])
                in members or not i.startswith("^")]
        del node.input[:]
        node.input.extend(kept)
        node.attr.pop("_class", None)
        node.device = ""
    scratch = tf.Graph()
    with scratch.as_default():
        input_map = {}
        for name in view.feeds:
            tensor = graph.get_tensor_by_name(name)
            shape = (feed_shapes or {}).get(name, tensor.shape)
            input_map[name] = tf.compat.v1.placeholder(tensor.dtype, shape)
            if tensor.dtype in (tf.resource, tf.variant):  # a fed variable handle (TF2)
                handle_data_util.copy_handle_data(tensor, input_map[name])
        used = {t for n in view.nodes.values() for t in n.inputs}
        input_map = {k: v for k, v in input_map.items() if k in used}
        tf.graph_util.import_graph_def(graph_def, input_map=input_map, name="s")
    return scratch


def resolve_shapes(graph, view, feed_shapes, scratch=None):
    """{tensor name: shape tuple or None} for every output of the view's nodes and sources.

    `feed_shapes` maps fed tensor names to concrete shapes.  Without feeds of
    unknown shape, the view's static shapes are returned as they are.  `scratch`:
    `import_request(graph, view, feed_shapes)`, when the caller has made it (a copy of
    a 100k-op request takes seconds).
    """
    static = {f"{name}:{i}": info.shape
              for nodes in (view.nodes, view.sources) for name, node in nodes.items()
              for i, info in enumerate(node.outputs)}
    if not feed_shapes:
        return static
    if scratch is None:
        scratch = import_request(graph, view, feed_shapes)
    resolved, ops = {}, tf_private.ops_by_name(scratch)
    for name in static:
        op_name, index = split_tensor_name(name)
        shape = ops["s/" + op_name].outputs[index].shape
        resolved[name] = None if shape.rank is None else tuple(shape.as_list())
    return resolved
