"""Equal subexpressions: which copy Grappler keeps in the whole function, and each partition's names for them.

Grappler's arithmetic optimizer deduplicates equal computations
(`DedupComputations`: same op, attributes and inputs; equal constants count
as one) and keeps the copy that comes first in its own topological order of
the graph as it stands after the passes before it.  A partition function is
optimised on its own, with another graph, so it may keep the other copy, or
keep both (one in each partition).  The copy's name matters: the optimizer
then turns sums into AddN and orders their inputs by name
(`sorted_names`), so a sum reading `mul_1` where the whole function reads
`mul_3` adds in another order and differs in the last bits.

    whole function:   add_2 = relu + mul + mul_3     add_5 = relu_1 + mul_2 + mul_3
    partition (main): add_2 = relu + mul + mul_1     add_5 = relu_1 + mul_1 + mul_2

Which copy survives is Grappler's order, not a rule tfmem can restate, so
tfmem asks Grappler: the traced graph is optimised once, offline, with the
default configuration (`kept_copies`), only when it has equal
subexpressions that feed different sums.  Then in each partition (`PartitionNames`)
a read of a copy reads the kept one where the partition has it, and
otherwise the copy standing for it there carries the kept one's name.
"""

import logging

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem import tf_private

log = logging.getLogger(__name__)

_SUMS = frozenset({"Add", "AddV2", "AddN"})  # what the arithmetic optimizer regroups


def _signature(op, representative):
    if op.type == "Const":
        return ("Const", op.node_def.attr["value"].SerializeToString())
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True))
                         for k, v in op.node_def.attr.items() if not k.startswith("_")))
    inputs = tuple(f"{representative.get(t.op.name, t.op.name)}:{t.value_index}"
                   for t in op.inputs)
    return (op.type, op.device, inputs, attrs,
            tuple(sorted(representative.get(c.name, c.name) for c in op.control_inputs)))


def _is_pure(op):
    try:
        return not op.op_def.is_stateful and op.type not in ("Placeholder", "VarHandleOp")
    except (AttributeError, ValueError, KeyError):
        return False


def equal_groups(graph):
    """Groups (tuples of op names, two or more) of single-output ops of `graph` that
    compute the same value: same op, attributes and inputs, equal constants as one."""
    representative, groups = {}, {}
    for op in graph.get_operations():  # producers before consumers in a FuncGraph
        if not _is_pure(op):
            continue
        group = groups.setdefault(_signature(op, representative), [])
        if group:
            representative[op.name] = group[0]
        group.append(op.name)
    return [tuple(g) for g in groups.values()
            if len(g) > 1 and len(graph.get_operation_by_name(g[0]).outputs) == 1]


def _sums_differ(graph, group):
    """Whether the copies feed different sums, so that the sums' order hangs on which copy
    Grappler keeps (copies feeding one AddN sit together in its order either way).
    Equal constants are left out: constants are copied into every partition that reads
    them, and asking Grappler costs a first step seconds on a ResNet of 2,400 ops."""
    ops = [graph.get_operation_by_name(name) for name in group]
    if ops[0].type == "Const":
        return False
    sums = {frozenset(c.name for c in op.outputs[0].consumers() if c.type in _SUMS)
            for op in ops}
    return len(sums) > 1 and any(sums)


def kept_copies(graph):
    """{copy: the copy Grappler keeps} for the equal single-output computations of the
    traced `graph` that feed different sums (empty when there are none, without asking
    Grappler)."""
    groups = [g for g in equal_groups(graph) if _sums_differ(graph, g)]
    if not groups:
        return {}
    meta_graph = tf.compat.v1.train.export_meta_graph(graph_def=graph.as_graph_def(),
                                                      graph=graph)
    fetches = meta_graph.collection_def["train_op"].node_list.value
    fetches.extend([t.name for t in graph.outputs] + [op.name for op in graph.control_outputs])
    try:
        optimized = tf_private.grappler_optimize(config_pb2.ConfigProto(), meta_graph)
    except Exception as error:  # pylint: disable=broad-except
        log.info("Grappler did not optimise the traced graph (%s): equal subexpressions "
                 "keep their own names in partitions", error)
        return {}
    survivors = {node.name for node in optimized.node}
    kept = {}
    for group in groups:
        alive = [name for name in group if name in survivors]
        if len(alive) == 1:  # one copy left: the one every partition should name
            kept.update({name: alive[0] for name in group if name != alive[0]})
    return kept


class PartitionNames:
    """A partition's reads and names of equal computations (see the module docstring)."""

    def __init__(self, seen, kept, members, inputs):
        """`seen`: the whole function's names; `kept`: kept_copies; `members`: the op
        names whose nodes the partition holds; `inputs`: the tensors it is fed."""
        self._seen = seen
        available = set(members) | {t.rpartition(":")[0] for t in inputs}
        self._read = {}  # copy -> the op it reads instead
        self._named = {}  # op -> the name it carries
        by_kept = {}
        for copy, keeper in kept.items():
            by_kept.setdefault(keeper, []).append(copy)
        for keeper, copies in by_kept.items():
            here = [c for c in sorted(copies) if c in available]
            if not here:
                continue
            stand_in = keeper if keeper in available else here[0]
            if stand_in != keeper:
                self._named[stand_in] = keeper
            for copy in here:
                if copy != stand_in:
                    self._read[copy] = stand_in

    def read(self, tensor):
        """The tensor a reader of `tensor` reads in this partition."""
        op, _, index = tensor.partition(":")
        stand_in = self._read.get(op)
        return tensor if stand_in is None else stand_in + (":" + index if index else "")

    def seen(self, op_name):
        """The name Grappler sees, in the whole function, for the value op `op_name` makes."""
        return self._seen(self._named.get(op_name, op_name))
