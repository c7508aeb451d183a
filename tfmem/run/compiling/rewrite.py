"""Rewrite: copy each partition of a plan into the session's graph.

A partition becomes a copy of its ops, imported with `import_graph_def`
under its own name scope.  The user's ops are never changed; the copies
read them through `input_map`:

    fed tensor x:0        -> the original x:0 (the executor feeds it)
    state source w        -> the original w (same variable, same state)
    constant c, original r -> the original (see analyse: originals)
    transfer h:0          -> read by a ticket placeholder (GetSessionTensor of a
                             session handle, or a staging key: see residence),
                             fed the producer's ticket or one the prefetcher uploaded

An original (see analyse) runs as the user's op; where it reads a computed
tensor, the callable connects the tensor the partition has (a copy's output
or a transfer's GetSessionTensor) to the original's input:

    copy: p3/dropout/Shape:0 --tensor_connection--> dropout/Shape:0 -> RandomUniform

The connection cuts the input's data edge like a feed, so the user's Shape
and everything before it stay out of the call, and the random op's kernel
(one per op name and session) keeps drawing from its one stream.

Control edges from ops outside the partition are dropped: those ops ran in
an earlier partition, and keeping the edge would make Session.run run them
again.  A NoOp joins the partition's sinks so one target runs every op.
Outputs kept on the device are fetched as tickets (GetSessionHandle, or a
staging key on a distributed session), and the last reader of each device
copy frees it in-graph (DeleteSessionTensor, MapUnstage), so no extra
Session.run is spent on freeing.  Outputs
swapped to host are fetched as values.
"""

import contextlib
import dataclasses

import tensorflow as tf

from tfmem.memory import op_order
from tfmem.run.compiling import graph_growth
from tfmem.plan.analyse import canonical_input, split_tensor_name
from tfmem.plan.build import connected_inputs

_DONE = "tfmem_partition_done"


@dataclasses.dataclass(frozen=True)
class Program:
    """The names one partition's Session call feeds, fetches and runs."""
    index: int
    feeds: tuple  # graph tensor names, in call order
    feed_sources: tuple  # per feed: the request's fed tensor or the transfer's name
    fetches: tuple  # graph tensor names
    fetch_sinks: tuple  # per fetch: (HANDLE | HOST | RESULT, tensor name)
    targets: tuple  # op names
    connections: tuple = ()  # (from tensor, to tensor): what the originals read instead
    scope: str = ""  # the name scope its copies are imported under: `<scope>/<op name>`


HANDLE, HOST, RESULT = "handle", "host", "result"


def keep_colocation_within(node, members):
    """Keep only the colocation constraints (`_class` "loc:@op") naming ops in `members`:
    a constraint on an op outside the copy cannot be met where the copy is imported."""
    if "_class" in node.attr:
        inside = [c for c in node.attr["_class"].list.s if c.decode()[5:] in members]
        if inside:
            node.attr["_class"].list.s[:] = inside
        else:
            del node.attr["_class"]


@contextlib.contextmanager
def clean_context(graph):
    """Add ops at top level, free of the caller's control, device and colocation scopes
    (also to a finalized graph: see graph_growth)."""
    with graph_growth.additions_allowed(graph), \
            graph.as_default(), graph.name_scope(None), graph.control_dependencies(None), \
            graph.device(None), graph.colocate_with(None, ignore_existing=True):
        yield


def gate_after(graph, op, name="gate"):
    """A new constant that runs after `op` (an Operation): input_map maps a control
    input to a tensor, so a control edge from an existing op is mapped to this gate.

    The edge is added to the new constant alone: `Graph.control_dependencies([op])`
    would set `_has_manual_control_dependencies` on `op`, a change of the user's op
    (after its first run TensorFlow warns that the change has no effect)."""
    gate = tf.constant(0, name=name)
    gate.op._add_control_input(op)  # pylint: disable=protected-access
    return gate


def add_node(graph_def, name, op, inputs=(), **types):
    """Append a NodeDef `name` of type `op` reading `inputs`; `types`: its type attributes."""
    node = graph_def.node.add(name=name, op=op)
    node.input.extend(inputs)
    for attr, dtype in types.items():
        node.attr[attr].type = tf.as_dtype(dtype).as_datatype_enum
    return node


def copy_chains(view, partitions_ops):
    """The chains the copies of these partitions (each a sequence of the view's ops) run
    in: one per partition the runner chains (op_order.chained_order), its originals left
    out (they are not copied)."""
    chains = (op_order.chained_order(view, ops) for ops in partitions_ops)
    return [[op for op in chain if op not in view.originals]
            for chain in chains if chain is not None]


def freed_last_readers(view, chains, deleters):
    """{op: the deleters it waits for}: each op of `chains` (copy_chains) that reads last,
    in their order, a transfer tensor of `deleters` ({tensor: its in-graph deleter}).

    The deleter runs before that last reader, so the reader holds the only reference to
    the tensor's buffer and TensorFlow lets an elementwise kernel write its output there
    (forwarding), as the simulator counts for chained partitions.  Unchained partitions
    get none."""
    last = {}
    for op in (op for chain in chains for op in chain):
        for tensor in view.nodes[op].inputs:
            if tensor in deleters:
                last[tensor] = op
    waits = {}
    for tensor, op in last.items():
        waits.setdefault(op, []).append(deleters[tensor])
    return waits


def _partition_graph_def(graph, view, ops, originals, chains=(), waits=None):
    """NodeDefs of the partition's copied ops, with the view's control edges.

    Control edges come from the view (analysis may have moved some); those
    from outside the partition are dropped, except from `originals` (run as
    the user's op in this partition), which the caller maps with a gate.
    In each of `chains` (sequences of `ops`) an op also waits for the one
    before it (see op_order.chained_order), and for the names `waits` gives it
    ({op: [names]}, mapped by the caller).
    """
    members = set(ops)
    after = {op: before for chain in chains for before, op in zip(chain, chain[1:])}
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    consumed = set()
    for name in ops:
        node = graph_def.node.add()
        node.CopyFrom(graph.get_operation_by_name(name).node_def)
        data = [inp for inp in node.input if not inp.startswith("^")]
        control = [src for src in view.nodes[name].control_inputs
                   if src in members or src in originals]
        producers = {split_tensor_name(canonical_input(inp))[0] for inp in data}
        before = after.get(name)
        if before is not None and before not in producers and before not in control:
            control.append(before)
        consumed.update(producers)
        consumed.update(control)
        del node.input[:]
        node.input.extend(data + ["^" + src for src in control]
                          + ["^" + src for src in (waits or {}).get(name, ())])
        keep_colocation_within(node, members)
    done = graph_def.node.add(name=_DONE if _DONE not in members else _DONE + "_", op="NoOp")
    done.input.extend("^" + name for name in ops if name not in consumed)
    return graph_def, done.name


def prefixed_copies(graph, view, ops, originals, prefix, outside_control, outside_data,
                    chains=(), waits=None):
    """The partition's copies for an import of the whole plan (plan_import, prun_import),
    named `<prefix>/<op>`: an input from another copy of the partition reads that copy,
    and `outside_control(src)` / `outside_data(tensor)` name every other input; `chains`
    as `copy_chains`; `waits` {op: [GraphDef names]}: control inputs a copy also takes
    (the deleters of `freed_last_readers`).

    Returns (NodeDefs, the NoOp after all of them, the copies that read no other copy).
    """
    part, done = _partition_graph_def(graph, view, ops, originals, chains)
    members = set(ops)
    loose = set()
    for node in part.node:
        inputs, inside = [], False
        for inp in node.input:
            if inp.startswith("^"):
                if inp[1:] in members:
                    inputs.append(f"^{prefix}/{inp[1:]}")
                    inside = True
                else:  # an original of this partition (see _partition_graph_def)
                    inputs.append(outside_control(inp[1:]))
                continue
            tensor = canonical_input(inp)
            op, index = split_tensor_name(tensor)
            if op in members:
                inputs.append(f"{prefix}/{op}:{index}")
                inside = True
            else:
                inputs.append(outside_data(tensor))
        del node.input[:]
        node.input.extend(inputs + ["^" + name for name in (waits or {}).get(node.name, ())])
        if "_class" in node.attr:  # kept only within the copy (keep_colocation_within)
            node.attr["_class"].list.s[:] = [
                b"loc:@" + f"{prefix}/".encode() + c[5:] for c in node.attr["_class"].list.s]
        node.name = f"{prefix}/{node.name}"
        if not inside:
            loose.add(node.name)
    return part.node, f"{prefix}/{done}", loose


def _transfer_inputs(graph, plan, partition, residence):
    """Feed points for the partition's transfers: input_map entries, feeds, deleters.

    The residence decides where a kept tensor waits (see residence): the
    partition feeds a ticket (a session handle, a staging key) and reads the
    tensor by it.
    """
    input_map, feeds, sources, targets, deleters = {}, [], [], [], {}
    for name in partition.inputs:
        info = plan.view.tensor(name)
        stem = split_tensor_name(name)[0].replace("/", "_")
        transfer = plan.transfer(name)
        key = (name, transfer.span_of(partition.index).readers[0])
        value, holder, deleter = residence.read(graph, name, info, key,
                                                transfer.frees_at(partition.index), stem)
        if info.shape is not None:
            value.set_shape(info.shape)
        if deleter is not None:
            targets.append(deleter.name)
            deleters[name] = deleter
        feeds.append(holder.name)
        input_map[name] = value
        sources.append(name)
    return input_map, feeds, sources, targets, deleters


def _host_copies(graph, plan, scope):
    """One copy of each constant the placement reads from the host (its original stayed)."""
    if not plan.placement.copied:
        return {}
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    for name, device in plan.placement.copied.items():
        node = graph_def.node.add()
        node.CopyFrom(graph.get_operation_by_name(name).node_def)
        node.device = device
        node.attr.pop("_class", None)
    names = [f"{name}:0" for name in plan.placement.copied]
    with clean_context(graph):
        copies = tf.graph_util.import_graph_def(graph_def, return_elements=names,
                                                name=scope + "/host")
    return dict(zip(names, copies))


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
                input_map["^" + src] = gate_after(graph, graph.get_operation_by_name(src))


def rewrite_partition(graph, plan, partition, scope, host_copies, residence):
    """Copy one partition into `graph` under `scope`; return its Program."""
    view = plan.view
    copied = [op for op in partition.ops if op not in view.originals]
    originals = [op for op in partition.ops if op in view.originals]
    with clean_context(graph):
        with graph.name_scope(scope + "_in/"):
            input_map, feeds, feed_sources, targets, deleters = _transfer_inputs(
                graph, plan, partition, residence)
        input_map.update(host_copies)
        feeds += partition.feeds
        feed_sources += partition.feeds
        # Fed tensors, sources and the partition's originals are read where they are.
        with graph.name_scope(scope + "_gates/"):
            _originals_map(graph, view, set(copied), set(originals), input_map)
        targets += originals

        connected = connected_inputs(view, partition)
        tensors = {}
        if copied:
            chains = copy_chains(view, [partition.ops])
            waits = {}
            with graph.name_scope(scope + "_in/"):
                for reader, its_deleters in freed_last_readers(view, chains, deleters).items():
                    # input_map names tensors: the reader waits for a gate after the deleter
                    for deleter in its_deleters:
                        freed = gate_after(graph, deleter, name="freed")
                        waits.setdefault(reader, []).append(freed.op.name)
                        input_map["^" + freed.op.name] = freed
            graph_def, done = _partition_graph_def(graph, view, copied, set(originals), chains,
                                                   waits)
            wanted = [t for t in dict.fromkeys(partition.outputs + partition.fetches + connected)
                      if split_tensor_name(t)[0] in copied]
            read = {t for op in copied for t in view.nodes[op].inputs}  # not originals' reads
            imported = tf.graph_util.import_graph_def(
                graph_def, input_map={k: v for k, v in input_map.items()
                                      if k in read or k.startswith("^")},
                return_elements=wanted + [done], name=scope)
            tensors = dict(zip(wanted, imported[:-1]))
            targets.append(imported[-1].name)
        connections = tuple((tensors[t].name if t in tensors else input_map[t].name, t)
                            for t in connected)

        fetches, sinks = [], []
        with graph.name_scope(scope + "_out/"):
            for name in partition.outputs:
                tensor = tensors[name] if name in tensors else graph.get_tensor_by_name(name)
                transfer = plan.transfer(name)
                residence.produced(name, tensor)
                if transfer.kept:
                    key = (name, transfer.spans[0].readers[0])
                    fetches.append(residence.keep(graph, name, tensor, key).name)
                    sinks.append((HANDLE, name))
                if transfer.swapped:
                    fetches.append(tensor.name)
                    sinks.append((HOST, name))
        for name in partition.fetches:
            fetches.append(tensors[name].name if name in tensors else name)
            sinks.append((RESULT, name))
        if any(kind == HANDLE for kind, _ in sinks):  # e.g. a staging step's key base
            for placeholder, source in residence.step_feeds:
                feeds.append(placeholder)
                feed_sources.append(source)
    return Program(partition.index, tuple(feeds), tuple(feed_sources), tuple(fetches),
                   tuple(sinks), tuple(targets), connections, scope)


def rewrite(graph, plan, scope, residence):
    """Programs for every partition of the plan, copied under `scope`/p<index>.

    `residence` keeps the plan's cross-partition tensors on the device (see residence).
    """
    host_copies = _host_copies(graph, plan, scope)
    programs = []
    for p in plan.partitions:
        read = {t for name in p.ops if name not in plan.view.originals
                for t in plan.view.nodes[name].inputs}
        used = {t: c for t, c in host_copies.items() if t in read}
        programs.append(rewrite_partition(graph, plan, p, f"{scope}/p{p.index}", used,
                                          residence))
    return tuple(programs)
