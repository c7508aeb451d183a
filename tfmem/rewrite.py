"""Rewrite: copy each partition of a plan into the session's graph.

A partition becomes a copy of its ops, imported with `import_graph_def`
under its own name scope.  The user's ops are never changed; the copies
read them through `input_map`:

    fed tensor x:0        -> the original x:0 (the executor feeds it)
    state source w        -> the original w (same variable, same state)
    constant c, original r -> the original (see analyse: originals)
    transfer h:0, device  -> GetSessionTensor(handle placeholder)
    transfer h:0, host    -> a placeholder fed with the host array

Control edges from ops outside the partition are dropped: those ops ran in
an earlier partition, and keeping the edge would make Session.run run them
again.  A NoOp joins the partition's sinks so one target runs every op.
Outputs kept on the device are fetched through GetSessionHandle, and the
last consuming partition deletes the handle in-graph (DeleteSessionTensor),
so no extra Session.run is spent on freeing.
"""

import contextlib
import dataclasses

import tensorflow as tf

from tfmem.analyse import split_tensor_name
from tfmem.plan import Residency

_DONE = "tfmem_partition_done"


@dataclasses.dataclass(frozen=True)
class Program:
    """The names one partition's Session call feeds, fetches and runs."""
    index: int
    feeds: tuple  # graph tensor names, in call order
    feed_sources: tuple  # per feed: the request's fed tensor or the transfer's name
    fetches: tuple  # graph tensor names
    fetch_sinks: tuple  # per fetch: (True, transfer name) or (False, requested tensor)
    targets: tuple  # op names
    releases: tuple  # transfers whose last reader is this partition


@contextlib.contextmanager
def clean_context(graph):
    """Add ops at top level, free of the caller's control, device and colocation scopes."""
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
            graph.device(None), graph.colocate_with(None, ignore_existing=True):
        yield


def _canonical(name):
    return name if ":" in name else name + ":0"


def _partition_graph_def(graph, ops, originals):
    """NodeDefs of the partition's copied ops; control edges from outside dropped.

    Control edges from `originals` (run as the user's op in this partition)
    are kept; the caller maps them with a gate.
    """
    members = set(ops)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    consumed = set()
    for name in ops:
        node = graph_def.node.add()
        node.CopyFrom(graph.get_operation_by_name(name).node_def)
        kept = []
        for inp in node.input:
            src = inp[1:] if inp.startswith("^") else split_tensor_name(_canonical(inp))[0]
            if src in members:
                consumed.add(src)
            elif inp.startswith("^") and src not in originals:
                continue
            kept.append(inp)
        del node.input[:]
        node.input.extend(kept)
        if "_class" in node.attr:
            inside = [c for c in node.attr["_class"].list.s if c.decode()[5:] in members]
            if inside:
                node.attr["_class"].list.s[:] = inside
            else:
                del node.attr["_class"]
    done = graph_def.node.add(name=_DONE if _DONE not in members else _DONE + "_", op="NoOp")
    done.input.extend("^" + name for name in ops if name not in consumed)
    return graph_def, done.name


def _transfer_inputs(graph, plan, partition):
    """Feed points for the partition's transfers: input_map entries, feeds, deleters."""
    input_map, feeds, sources, targets = {}, [], [], []
    for name in partition.inputs:
        transfer = plan.transfer(name)
        info = plan.view.tensor(name)
        stem = split_tensor_name(name)[0].replace("/", "_")
        if transfer.residency is Residency.DEVICE:
            holder = tf.compat.v1.placeholder(tf.string, [], name=f"{stem}_handle")
            value = tf.raw_ops.GetSessionTensor(handle=holder, dtype=info.dtype, name=f"{stem}_read")
            if info.shape is not None:
                value.set_shape(info.shape)
            if transfer.last_consumer == partition.index:
                with graph.control_dependencies([value.op]):
                    targets.append(tf.raw_ops.DeleteSessionTensor(handle=holder).name)
            feeds.append(holder.name)
        else:
            value = tf.compat.v1.placeholder(info.dtype, info.shape, name=f"{stem}_host")
            feeds.append(value.name)
        input_map[name] = value
        sources.append(name)
    return input_map, feeds, sources, targets


def _originals_map(graph, view, copied, originals, input_map):
    """Map what the copies read from outside the copies (feeds, sources, originals).

    A control edge from an original is mapped to a gate: a constant that
    depends on the original, since input_map can only name a tensor.
    """
    for name in copied:
        node = view.nodes[name]
        for tensor in node.inputs:
            if tensor not in input_map and split_tensor_name(tensor)[0] not in copied:
                input_map[tensor] = graph.get_tensor_by_name(tensor)
        for src in node.control_inputs:
            if src in originals and "^" + src not in input_map:
                with graph.control_dependencies([graph.get_operation_by_name(src)]):
                    input_map["^" + src] = tf.constant(0, name="gate")


def rewrite_partition(graph, plan, partition, scope):
    """Copy one partition into `graph` under `scope`; return its Program."""
    view = plan.view
    copied = [op for op in partition.ops if op not in view.originals]
    originals = [op for op in partition.ops if op in view.originals]
    with clean_context(graph):
        with graph.name_scope(scope + "_in/"):
            input_map, feeds, feed_sources, targets = _transfer_inputs(graph, plan, partition)
        feeds += partition.feeds
        feed_sources += partition.feeds
        # Fed tensors, sources and the partition's originals are read where they are.
        with graph.name_scope(scope + "_gates/"):
            _originals_map(graph, view, set(copied), set(originals), input_map)
        targets += originals

        tensors = {}
        if copied:
            graph_def, done = _partition_graph_def(graph, copied, set(originals))
            wanted = [t for t in dict.fromkeys(partition.outputs + partition.fetches)
                      if split_tensor_name(t)[0] in copied]
            imported = tf.graph_util.import_graph_def(
                graph_def, input_map=input_map, return_elements=wanted + [done], name=scope)
            tensors = dict(zip(wanted, imported[:-1]))
            targets.append(imported[-1].name)

        fetches, sinks = [], []
        with graph.name_scope(scope + "_out/"):
            for name in partition.outputs:
                tensor = tensors[name] if name in tensors else graph.get_tensor_by_name(name)
                if plan.transfer(name).residency is Residency.DEVICE:
                    with graph.colocate_with(tensor.op):
                        tensor = tf.raw_ops.GetSessionHandle(value=tensor)
                fetches.append(tensor.name)
                sinks.append((True, name))
        for name in partition.fetches:
            fetches.append(tensors[name].name if name in tensors else name)
            sinks.append((False, name))
    releases = tuple(t for t in partition.inputs if plan.transfer(t).last_consumer == partition.index)
    return Program(partition.index, tuple(feeds), tuple(feed_sources), tuple(fetches),
                   tuple(sinks), tuple(targets), releases)


def rewrite(graph, plan, scope):
    """Programs for every partition of the plan, copied under `scope`/p<index>."""
    return tuple(rewrite_partition(graph, plan, p, f"{scope}/p{p.index}") for p in plan.partitions)
