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


def node_defs(graph, view):
    """{op name: its NodeDef serialized} of the request's nodes and sources, in view order
    (the copy and the dedup signatures read them; serialising one costs microseconds)."""
    ops, serialized = tf_private.ops_by_name(graph), tf_private.serialized_node_def
    return {name: serialized(ops[name]) for names in (view.nodes, view.sources) for name in names}


def import_request(graph, view, feed_shapes, serialized=None):
    """A scratch graph holding a copy of the request's ops under the prefix "s/", each fed
    tensor replaced by a placeholder of its shape in `feed_shapes` (when given);
    `serialized`: `node_defs(graph, view)`, when the caller has them.

    Shape inference runs as the copies are imported; nothing runs, and the user's
    graph is not touched.  `scratch.calibrate` reads concrete input shapes and
    constant shape vectors from it.  The copies keep the user's devices and
    colocations: the scratch graph never runs (calibration copies the kernels it
    measures into graphs of their own, devices cleared).
    """
    serialized = node_defs(graph, view) if serialized is None else serialized
    members = serialized.keys()
    header = tf.compat.v1.GraphDef()
    header.versions.CopyFrom(graph.graph_def_versions)
    library = None
    if tf_private.has_functions(graph):  # else serialising the graph finds no library
        library = graph.as_graph_def().library
        header.library.CopyFrom(library)
    nodes = [_node_entry(node_def, members) for node_def in serialized.values()]
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
        tf_private.import_for_shapes(scratch, header.SerializeToString() + b"".join(nodes),
                                     "s", input_map, library)
    return scratch


def _node_entry(serialized, members):
    """A NodeDef (`serialized`) as a GraphDef's `node` field, in its wire format (field 1,
    length-delimited: a GraphDef is the concatenation of its fields), its control
    inputs from ops outside `members` left out.  Only a NodeDef holding a "^" byte can
    have control inputs, and only those are parsed: a copy of a 100k-op request
    otherwise spends seconds parsing NodeDefs to write them back unchanged."""
    if b"^" in serialized:
        node = tf.compat.v1.NodeDef.FromString(serialized)
        kept = [i for i in node.input if not i.startswith("^") or i[1:] in members]
        if len(kept) != len(node.input):
            del node.input[:]
            node.input.extend(kept)
            serialized = node.SerializeToString()
    return b"\n" + _varint(len(serialized)) + serialized


def _varint(value):
    """`value` (>= 0) as a protocol buffer varint: 7 bits a byte, low bits first."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def resolve_shapes(graph, view, feed_shapes, scratch=None):
    """{tensor name: shape tuple or None} for every output of the view's nodes and sources.

    `feed_shapes` maps fed tensor names to concrete shapes.  Without feeds of
    unknown shape, the view's static shapes are returned as they are.  `scratch`:
    `import_request(graph, view, feed_shapes)`, when the caller has made it (a copy of
    a 100k-op request takes seconds).
    """
    if not feed_shapes:
        return {f"{name}:{i}": info.shape
                for nodes in (view.nodes, view.sources) for name, node in nodes.items()
                for i, info in enumerate(node.outputs)}
    if scratch is None:
        scratch = import_request(graph, view, feed_shapes)
    resolved, ops, static_shape = {}, tf_private.ops_by_name(scratch), tf_private.static_shape
    for nodes in (view.nodes, view.sources):
        for name, node in nodes.items():
            for tensor, output in zip(ops["s/" + name].outputs, node.output_names):
                dims, unknown_rank = static_shape(tensor)
                resolved[output] = None if unknown_rank else tuple(dims)
    return resolved
