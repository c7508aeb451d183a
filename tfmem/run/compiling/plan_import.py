"""One import per plan: every partition's copies and session-handle ops in one GraphDef.

`rewrite.rewrite` copies a plan partition by partition: one `import_graph_def`
per partition, and the transfer ops (handle placeholder, GetSessionTensor,
DeleteSessionTensor, GetSessionHandle) built one by one through TensorFlow's
Python op constructors.  Each import indexes every name of the session graph
first, so a plan of n partitions pays n times the graph's size, and each op
constructor costs about a millisecond of Python.

Here the whole plan is one GraphDef, imported once under the plan's scope:

    p3/<op>                     copy of the user's op, read by the other copies of p3
    p3_in/<stem>_handle         Placeholder(string): the ticket the executor feeds
    p3_in/<stem>_read           GetSessionTensor(handle), shaped as the original tensor
    p3_in/<stem>_free           DeleteSessionTensor(handle) after the read (last reader)
    p3_out/<stem>_keep          GetSessionHandle of a kept output of a copy
    p3/tfmem_partition_done     NoOp joining the partition's sinks
    ext/<tensor>                what the copies read from the user's graph (input_map)

The Programs it returns name the same feeds, fetches and targets, in the same
order, as `rewrite.rewrite`'s, so the executor cannot tell them apart.  What
reads or colocates with existing ops (a gate on an original's control edge,
a host copy of a constant, the keep of an original's output) is built as in
`rewrite`.  Only the session-handle residence is written as NodeDefs; others
(staging on a distributed session) go through `rewrite.rewrite`.
"""

import tensorflow as tf

from tfmem.run.compiling import rewrite as partition_rewrite
from tfmem.plan.analyse import split_tensor_name
from tfmem.plan.build import connected_inputs
from tfmem.run.executing.residence import SessionHandles
from tfmem.run.compiling.rewrite import (HANDLE, HOST, RESULT, Program, add_node, clean_context,
                                gate_after)

_EXTERNAL = "ext/"


def supports(residence):
    """True where the residence's ops are the session-handle ops written here."""
    return type(residence) is SessionHandles  # pylint: disable=unidiomatic-typecheck


class _Names:
    """Unique node names inside one GraphDef (two tensors of one op share a stem)."""

    def __init__(self):
        self._used = set()

    def __call__(self, name):
        unique, n = name, 0
        while unique in self._used:
            n += 1
            unique = f"{name}_{n}"
        self._used.add(unique)
        return unique


class _PartitionDef:
    """One partition written into the plan's GraphDef; names relative to the plan scope."""

    def __init__(self, plan, partition):
        self.partition = partition
        self.prefix = f"p{partition.index}"
        view = plan.view
        self.copied = [op for op in partition.ops if op not in view.originals]
        self.originals = [op for op in partition.ops if op in view.originals]
        self.copied_set = set(self.copied)
        self.reads = {}  # transfer tensor -> its GetSessionTensor output
        self.holders = []  # ticket placeholders, in partition.inputs order
        self.frees = []  # DeleteSessionTensor ops
        self.free_of = {}  # transfer tensor -> its DeleteSessionTensor op
        self.keeps = {}  # kept output made by a copy -> its GetSessionHandle
        self.done = None
        self.gates = []  # originals whose control edges the copies keep

    def write_transfers(self, graph_def, plan, names):
        for name in self.partition.inputs:
            info = plan.view.tensor(name)
            stem = split_tensor_name(name)[0].replace("/", "_")
            holder = names(f"{self.prefix}_in/{stem}_handle")
            node = add_node(graph_def, holder, "Placeholder", dtype=tf.string)
            node.attr["shape"].shape.CopyFrom(tf.TensorShape([]).as_proto())
            read = names(f"{self.prefix}_in/{stem}_read")
            node = add_node(graph_def, read, "GetSessionTensor", [holder], dtype=info.dtype)
            if info.shape is not None:  # as rewrite's set_shape: the copies infer from it
                node.attr["_output_shapes"].list.shape.add().CopyFrom(tf.TensorShape(info.shape).as_proto())
            if plan.transfer(name).frees_at(self.partition.index):
                free = names(f"{self.prefix}_in/{stem}_free")
                add_node(graph_def, free, "DeleteSessionTensor", [holder, "^" + read])
                self.frees.append(free)
                self.free_of[name] = free
            self.holders.append(holder)
            self.reads[name] = read + ":0"

    def write_copies(self, graph_def, graph, plan, external):
        """The copies, with inputs renamed: copies in this partition, transfers, or external."""
        if not self.copied:
            return

        def control(src):  # an original of this partition: a gate (see rewrite)
            self.gates.append(src)
            return "^" + _EXTERNAL + src

        def data(tensor):
            if tensor in external.host_copies:
                return external.map(tensor, external.host_copies[tensor])
            if tensor in self.reads:
                return self.reads[tensor]
            return external.map(tensor, graph.get_tensor_by_name(tensor))

        stages = self.partition.stages or ((self.partition.index, self.partition.ops),)
        chains = partition_rewrite.copy_chains(plan.view, [ops for _, ops in stages])
        nodes, self.done, _ = partition_rewrite.prefixed_copies(
            graph, plan.view, self.copied, set(self.originals), self.prefix, control, data,
            chains, partition_rewrite.freed_last_readers(plan.view, chains, self.free_of))
        graph_def.node.extend(nodes)
        if len(self.partition.stages) > 1:
            _stages_in_order(graph_def, graph_def.node[-len(nodes):], self.prefix,
                             self.partition.stages)

    def tensor_of_copy(self, tensor):
        """The copy's tensor name, if a copy of this partition makes `tensor`."""
        op, index = split_tensor_name(tensor)
        return f"{self.prefix}/{op}:{index}" if op in self.copied_set else None

    def write_keeps(self, graph_def, plan, names):
        """GetSessionHandle of each kept output a copy makes, colocated with its producer."""
        for name in self.partition.outputs:
            copy = self.tensor_of_copy(name)
            if copy is None or not plan.transfer(name).kept:
                continue
            stem = split_tensor_name(name)[0].replace("/", "_")
            keep = names(f"{self.prefix}_out/{stem}_keep")
            dtype = plan.view.tensor(name).dtype
            node = add_node(graph_def, keep, "GetSessionHandle", [copy], T=dtype)
            node.attr["_class"].list.s.append(b"loc:@" + copy.rpartition(":")[0].encode())
            self.keeps[name] = keep + ":0"


def _stages_in_order(graph_def, copies, prefix, stages):
    """Make the stages of a stretch (see stretches) run one after the other: each stage's
    copies that read no copy of their own stage wait for a NoOp after the stage before.

    `copies`: the stretch's NodeDefs from `rewrite.prefixed_copies`, copies named
    `<prefix>/<op>`."""
    stage_of = {f"{prefix}/{op}": s for s, (_, ops) in enumerate(stages) for op in ops}
    by_stage = [[] for _ in stages]
    reads_own_stage, read_in_stage = set(), set()
    for node in copies:
        if node.name not in stage_of:  # the NoOp after the whole stretch
            continue
        by_stage[stage_of[node.name]].append(node)
        for inp in node.input:
            src = inp[1:] if inp.startswith("^") else inp.rpartition(":")[0]
            if stage_of.get(src) == stage_of[node.name]:
                reads_own_stage.add(node.name)
                read_in_stage.add(src)
    previous = []  # the NoOp after the stage before, once there is one
    for s in range(1, len(stages)):
        done = add_node(graph_def, f"{prefix}_stages/done{s - 1}", "NoOp",
                        ["^" + n.name for n in by_stage[s - 1] if n.name not in read_in_stage]
                        + previous)
        previous = ["^" + done.name]
        for node in by_stage[s]:
            if node.name not in reads_own_stage:
                node.input.extend(previous)


class _External:
    """What the copies of the plan read from the session graph, by GraphDef name."""

    def __init__(self, host_copies):
        self.host_copies = host_copies
        self.input_map = {}

    def map(self, tensor, value):
        key = _EXTERNAL + tensor
        self.input_map[key] = value
        return key


def imports_whole_plans(residence, one_import=True):
    """Whether plans are copied by one import here (which can run stretches: `stretches`);
    `one_import` False copies them partition by partition (Options.one_import)."""
    return one_import and supports(residence)


def rewrite_plan(graph, plan, scope, residence, one_import=True, reused=None):
    """The plan's Programs: one import where the residence allows it, else per partition.
    `reused`: {partition index: Program} compiled for an earlier plan (see reuse), taken
    as they are where the plan is imported whole."""
    if imports_whole_plans(residence, one_import):
        return rewrite(graph, plan, scope, residence, reused)
    return partition_rewrite.rewrite(graph, plan, scope, residence)


def rewrite(graph, plan, scope, residence, reused=None):
    """Programs for every partition of the plan, copied under `scope`/p<index> in one
    import, but for the partitions `reused` gives a Program of ({index: Program}).

    `residence` must be a session-handle residence (see `supports`).
    """
    if not supports(residence):
        raise TypeError(f"plan_import writes session-handle ops only, not "
                        f"{type(residence).__name__}; use rewrite.rewrite")
    reused = reused or {}
    written = [p for p in plan.partitions if p.index not in reused]
    if not written:
        return tuple(reused[p.index] for p in plan.partitions)
    host_copies = partition_rewrite._host_copies(graph, plan, scope)  # pylint: disable=protected-access
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    names, external = _Names(), _External(host_copies)
    parts = [_PartitionDef(plan, p) for p in written]
    with clean_context(graph):
        for part in parts:
            part.write_transfers(graph_def, plan, names)
            part.write_copies(graph_def, graph, plan, external)
            part.write_keeps(graph_def, plan, names)
        for part in parts:  # a control edge from an original: a constant after it
            with graph.name_scope(f"{scope}/{part.prefix}_gates/"):
                for src in dict.fromkeys(part.gates):
                    external.input_map["^" + _EXTERNAL + src] = gate_after(
                        graph, graph.get_operation_by_name(src))
        tf.graph_util.import_graph_def(graph_def, input_map=external.input_map,
                                       name=scope + "/")
        programs = {part.partition.index: _program(graph, plan, part, scope, external, residence)
                    for part in parts}
    return tuple(reused.get(p.index) or programs[p.index] for p in plan.partitions)


def _program(graph, plan, part, scope, external, residence):
    """The partition's Program, in `rewrite.rewrite_partition`'s order of names."""
    p = part.partition

    def inside(name):
        return f"{scope}/{name}"

    feeds = [inside(h) + ":0" for h in part.holders] + list(p.feeds)
    feed_sources = list(p.inputs) + list(p.feeds)
    targets = [inside(f) for f in part.frees] + list(part.originals)
    if part.done is not None:
        targets.append(inside(part.done))

    def tensor_name(name):  # a fetch or an output: the copy's tensor, else the original
        copy = part.tensor_of_copy(name)
        return inside(copy) if copy is not None else name

    def read_by_original(name):  # as rewrite's input_map: copy, host copy, transfer, graph
        copy = part.tensor_of_copy(name)
        if copy is not None:
            return inside(copy)
        if name in external.host_copies:
            return external.host_copies[name].name
        if name in part.reads:
            return inside(part.reads[name])
        return name

    connections = tuple((read_by_original(t), t)
                        for t in connected_inputs(plan.view, p))
    fetches, sinks = [], []
    for name in p.outputs:
        transfer = plan.transfer(name)
        if transfer.kept:
            if name in part.keeps:
                fetches.append(inside(part.keeps[name]))
            else:  # an original's output: kept as rewrite keeps it
                with clean_context(graph), graph.name_scope(f"{scope}/{part.prefix}_out/"):
                    tensor = graph.get_tensor_by_name(name)
                    key = (name, transfer.spans[0].readers[0])
                    fetches.append(residence.keep(graph, name, tensor, key).name)
            sinks.append((HANDLE, name))
        if transfer.swapped:
            fetches.append(tensor_name(name))
            sinks.append((HOST, name))
    for name in p.fetches:
        fetches.append(tensor_name(name))
        sinks.append((RESULT, name))
    return Program(p.index, tuple(feeds), tuple(feed_sources), tuple(fetches), tuple(sinks),
                   tuple(targets), connections, inside(part.prefix))
