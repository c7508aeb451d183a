"""Merged kernels: ops a kernel path runs as one kernel, so nothing may be ordered between them.

With oneDNN on (TF_ENABLE_ONEDNN_OPTS=1, TensorFlow's default on CPUs with
AVX-512), TensorFlow's layout pass merges a Conv2DBackpropFilter and a
BiasAddGrad that read the same gradient (the filter gradient's input 2, the
bias gradient's input 0) into one `_MklNativeConv2DBackpropFilterWithBias`,
whichever path connects them.  Grappler runs first and removes forwards
(`tf.tuple`'s Identity between a gradient and the filter gradient reading it),
so the two match when they read one tensor through forwards:

    g --> Conv2DBackpropFilter          g --> Conv2DBackpropFilterWithBias
      \\-> BiasAddGrad --> summary           (both outputs)

If an op is ordered between the two (a control edge tfmem adds to chain a
partition's copies, or the NoOp that ends one stage of a stretch), the merged
kernel waits for that op and the op for the merged kernel: a cycle.
TensorFlow's executor then never runs the ops on it nor anything after them,
and a session callable returns empty tensors for their fetches without an
error.  So such ops are one unit (`units`, rule 7), which with the ops on the
paths between them (the gate and forwards of `tf.tuple`) joins one unit of
the unit graph's cycles: a partition lists a unit's ops together, and the
chained order (op_order, by plan position) runs them one after another.  With
oneDNN off nothing merges, and the pair costs nothing.
"""

from tfmem.plan import optypes
from tfmem.plan.analyse import split_tensor_name

# op type -> the input through which ops of these types merge when they read one tensor
SHARED_INPUT_MERGES = {"Conv2DBackpropFilter": 2, "BiasAddGrad": 0}


def _through_forwards(view, tensor):
    """The tensor `tensor` forwards, through the view's forwards Grappler may remove."""
    while True:
        node = view.nodes.get(split_tensor_name(tensor)[0])
        if node is None or node.type not in optypes.PRUNED_FORWARDS:
            return tensor
        tensor = node.inputs[split_tensor_name(tensor)[1] if node.type == "IdentityN" else 0]


def merged_groups(view, ops=None):
    """Groups (tuples of two or more op names, in `ops` order) of the view's ops, or of
    `ops` alone, that a kernel path may run as one kernel."""
    nodes = view.nodes.items() if ops is None else [(name, view.nodes[name]) for name in ops]
    by_tensor = {}
    for name, node in nodes:
        port = SHARED_INPUT_MERGES.get(node.type)
        if port is not None and port < len(node.inputs):
            by_tensor.setdefault(_through_forwards(view, node.inputs[port]), []).append(name)
    return [tuple(group) for group in by_tensor.values()
            if len({view.nodes[n].type for n in group}) > 1]
