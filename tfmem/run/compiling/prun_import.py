"""The copies of a plan for one partial run per step: gated partitions, direct edges.

A partial run (`Session.partial_run_setup`) builds one executor for a whole
request, once, and starts it; each later call feeds some tensors and
fetches others of that running executor.  One import per plan, as in
`plan_import`, but written for that executor:

    r3/<op>                 copy of the user's op
    r3_gate/gate            Placeholder(bool): fed by call 3, nothing of r3 runs before
    r3_gate/open            Switch(gate, gate):1: every copy of r3 waits for it; fed
                            False, it is dead, and so is all of r3 (nothing runs)
    r3_gate/done            Identity(open) after every op of r3: call 3 fetches it, so it
                            returns only when the whole partition has run
    stacks/<stem>           StackV2 of a kept transfer: the step's own (made at setup)
    r3_out/<stem>_push      the producer pushes the kept tensor
    r5_in/<stem>_pop        a reader pops it (and pushes it back if a later one reads it)
    r3_in/<stem>_handle     ticket placeholder of an uploaded (swapped) transfer,
    r3_in/<stem>_read/_free GetSessionTensor / DeleteSessionTensor, as in plan_import
    stop/gate, stop/done    fed True, closes every stack (a step stopped early); done
                            is a Merge, alive either way: the last call fetches it

A copy with no input from another copy of its partition gets a control
input from the gate: otherwise the executor would start it at setup (a
later partition's variable reads, constants, ops of fed tensors) and change
what is in memory when.  A transfer kept on the device waits on a stack
of the step (StackV2 lives in the run's step container): the last reader's
pop takes it off, and it is freed after that partition, as
DeleteSessionTensor frees a handle.  Not a session handle, because a
partial run's GetSessionHandle keeps every tensor it stored alive until the
whole step ends (DirectSession's TensorStore of the run state is emptied
only then); not a direct edge from producer to readers either, because
each partial-run call checks its fetches by walking all their ancestors
(DirectSession::CheckFetch), so edges between partitions made call k cost
O(k partitions): measured 4x slower for ResNet-56's last partitions.
Swapped transfers go through host buffers and session handles as on the
callable path.

Your ops that the plan runs as they are (originals: variable reads and
other stateful ops reading only fed tensors and state) cannot be gated
(tfmem never changes your ops): they are targets of the run and start as
soon as what they read is there, as in a plain `Session.run`.  Plans this
module does not support (`unsupported`) run their callables: originals that
read computed tensors (connected, see rewrite), a copied random op (its
stream would differ from the callables' copy), or results no copy computes.
"""

import dataclasses

import tensorflow as tf

from tfmem.plan import optypes
from tfmem.plan.analyse import split_tensor_name
from tfmem.plan.build import connected_inputs
from tfmem.run.compiling import rewrite as partition_rewrite
from tfmem.run.compiling.rewrite import HOST, RESULT, add_node, clean_context, gate_after

_EXTERNAL = "ext/"


@dataclasses.dataclass(frozen=True)
class PartialProgram:
    """What call `index` of a step's partial run feeds and fetches (graph tensor names)."""
    index: int
    gate: str
    feeds: tuple  # fed tensors, after the gate
    feed_sources: tuple  # per feed: the request's fed tensor or the transfer's name
    fetches: tuple  # distinct tensors; the last one is the partition's done token
    fetch_sinks: tuple  # (fetch position, HOST | RESULT, tensor name)


@dataclasses.dataclass(frozen=True)
class PartialRunGraph:
    """The plan's partial-run copies: one PartialProgram per partition, and the step's names."""
    programs: tuple
    stop_gate: str
    stop_done: str
    targets: tuple  # your ops run as they are (originals reading only feeds and state)

    @property
    def setup_feeds(self):
        return tuple(name for p in self.programs for name in (p.gate,) + p.feeds) + \
            (self.stop_gate,)

    @property
    def setup_fetches(self):
        return tuple(name for p in self.programs for name in p.fetches) + (self.stop_done,)


def unsupported(graph, plan):
    """Why the plan cannot run as one partial run per step, or None when it can."""
    view = plan.view
    for name in view.nodes:
        if name not in view.originals and \
                optypes.draws_random_stream(graph.get_operation_by_name(name)):
            return f"its copy of random op '{name}' would draw from a stream of its own"
    copied = {op for p in plan.partitions for op in p.ops if op not in view.originals}
    fetched = set()
    for p in plan.partitions:
        for tensor in p.fetches:
            if split_tensor_name(tensor)[0] not in copied | view.originals:
                return f"fetch '{tensor}' is fed or state, not computed in a partition"
            if tensor in fetched:
                return f"fetch '{tensor}' is fetched by two partitions"
            fetched.add(tensor)
        if connected_inputs(view, p):  # see rewrite: originals
            return "a partition connects computed tensors to your ops"
    return None


def _scalar_placeholder(graph_def, name, dtype):
    node = add_node(graph_def, name, "Placeholder", dtype=dtype)
    node.attr["shape"].shape.CopyFrom(tf.TensorShape([]).as_proto())
    return node


class _Writer:
    """Writes the plan's partitions into one GraphDef (names relative to the scope)."""

    def __init__(self, graph, plan, host_copies):
        self.graph, self.plan = graph, plan
        self.graph_def = tf.compat.v1.GraphDef()
        self.graph_def.versions.CopyFrom(graph.graph_def_versions)
        self.host_copies = host_copies
        self.input_map = {}
        self.producers = {}  # transfer tensor -> the producer copy's tensor name
        self.fed = set()  # the request's fed tensors a call already feeds
        self.stacks = {}  # kept transfer -> (its step's stack, dtype): see module
        self.originals = []  # your ops the plan runs as they are: the run's targets
        self.after_originals = set()  # originals some copy has a control edge from

    def external(self, tensor):
        value = self.host_copies.get(tensor) or self.graph.get_tensor_by_name(tensor)
        self.input_map[_EXTERNAL + tensor] = value
        return _EXTERNAL + tensor

    @staticmethod
    def stem(name):
        op, index = split_tensor_name(name)
        return f"{op.replace('/', '_')}_{index}"

    def push(self, name, tensor, prefix):
        """A stack for the kept transfer `name` (made when the run starts: a step's own)
        and the producer's push of `tensor` on it; the push's name."""
        dtype = self.plan.view.tensor(name).dtype
        stem = self.stem(name)
        size = add_node(self.graph_def, f"stacks/{stem}_size", "Const", dtype=tf.int32)
        size.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(-1, tf.int32))
        stack = add_node(self.graph_def, f"stacks/{stem}", "StackV2", [size.name], elem_type=dtype)
        stack.attr["stack_name"].s = stem.encode()
        self.stacks[name] = (stack.name, dtype)
        return add_node(self.graph_def, f"{prefix}_out/{stem}_push", "StackPushV2",
                        [stack.name, tensor], T=dtype).name

    def stop(self):
        """stop/gate fed True closes every stack (what a stopped step kept is freed);
        stop/done is alive either way (a Merge), so a normal step's last call fetches it."""
        graph_def = self.graph_def
        gate = _scalar_placeholder(graph_def, "stop/gate", tf.bool).name
        switch = add_node(graph_def, "stop/switch", "Switch", [gate, gate], T=tf.bool).name
        opened = add_node(graph_def, "stop/open", "Identity", [switch + ":1"], T=tf.bool).name
        closes = [add_node(graph_def, f"stop/close_{self.stem(name)}", "StackCloseV2",
                           [stack, "^" + opened]).name
                  for name, (stack, _) in self.stacks.items()]
        closed = add_node(graph_def, "stop/closed", "Identity",
                          [opened] + ["^" + c for c in closes], T=tf.bool).name
        done = add_node(graph_def, "stop/done", "Merge", [closed, switch + ":0"], T=tf.bool)
        done.attr["N"].i = 2
        return gate + ":0", done.name + ":0"

    def partition(self, partition):
        """Write one partition; (gate, feeds, sources, fetches, sinks) relative to the scope."""
        plan, graph_def = self.plan, self.graph_def
        k = partition.index
        prefix = f"r{k}"
        originals = [op for op in partition.ops if op in plan.view.originals]
        self.originals.extend(originals)
        ops = [op for op in partition.ops if op not in plan.view.originals]
        members = set(ops)
        gate = f"{prefix}_gate/gate"
        _scalar_placeholder(graph_def, gate, tf.bool)
        switch = add_node(graph_def, f"{prefix}_gate/switch", "Switch", [gate, gate],
                          T=tf.bool).name
        opened = add_node(graph_def, f"{prefix}_gate/open", "Identity", [switch + ":1"],
                          T=tf.bool).name
        feeds, sources, frees, reads, free_of = [], [], [], {}, {}
        for name in partition.inputs:  # uploaded spans: read by ticket, as plan_import
            transfer = plan.transfer(name)
            span = transfer.span_of(k)
            if not span.uploaded:
                reads[name] = self.producers[name]
                if name in self.stacks:  # kept: popped (and pushed back for later readers)
                    stack, dtype = self.stacks[name]
                    stem = self.stem(name)
                    pop = add_node(graph_def, f"{prefix}_in/{stem}_pop", "StackPopV2",
                                   [stack, "^" + opened], elem_type=dtype).name
                    reads[name] = pop + ":0"
                    if span.readers[-1] != k:
                        frees.append(add_node(graph_def, f"{prefix}_in/{stem}_repush",
                                              "StackPushV2", [stack, pop + ":0"], T=dtype).name)
                continue
            op, index = split_tensor_name(name)
            stem = f"{op.replace('/', '_')}_{index}"
            holder = _scalar_placeholder(graph_def, f"{prefix}_in/{stem}_handle", tf.string).name
            info = plan.view.tensor(name)
            read_node = add_node(graph_def, f"{prefix}_in/{stem}_read", "GetSessionTensor",
                                 [holder, "^" + opened], dtype=info.dtype)
            if info.shape is not None:  # as plan_import: the copies infer from it
                read_node.attr["_output_shapes"].list.shape.add().CopyFrom(
                    tf.TensorShape(info.shape).as_proto())
            read = read_node.name
            if transfer.frees_at(k):
                frees.append(add_node(graph_def, f"{prefix}_in/{stem}_free", "DeleteSessionTensor",
                                      [holder, "^" + read]).name)
                free_of[name] = frees[-1]
            feeds.append(holder + ":0")
            sources.append(name)
            reads[name] = read + ":0"
        for tensor in partition.feeds:  # each fed tensor is fed once per partial run
            if tensor not in self.fed:
                self.fed.add(tensor)
                feeds.append(tensor)
                sources.append(tensor)

        def control(src):  # an original, run as your op (see unsupported): a gate on it
            self.after_originals.add(src)
            return "^" + _EXTERNAL + src

        def data(tensor):
            if tensor in reads and not reads[tensor].startswith(_EXTERNAL):
                return reads[tensor]
            return self.external(tensor)

        chains = partition_rewrite.copy_chains(plan.view, [partition.ops])
        nodes, done, loose = partition_rewrite.prefixed_copies(
            self.graph, plan.view, ops, set(originals), prefix, control, data, chains,
            partition_rewrite.freed_last_readers(plan.view, chains, free_of))
        for node in nodes:  # a copy that reads no other copy waits for the gate
            if node.name in loose and node.name != done:
                node.input.append("^" + opened)
        graph_def.node.extend(nodes)
        for name in partition.outputs:
            op, index = split_tensor_name(name)
            self.producers[name] = (f"{prefix}/{op}:{index}" if op in members
                                    else _EXTERNAL + name)  # an original's: read as yours
            if op in members and plan.transfer(name).kept:
                frees.append(self.push(name, self.producers[name], prefix))
        token = add_node(graph_def, f"{prefix}_gate/done", "Identity",
                         [opened, "^" + done] + ["^" + f for f in frees], T=tf.bool).name
        fetches, sinks = [], []

        def fetch(tensor, kind, name):
            if tensor not in fetches:
                fetches.append(tensor)
            sinks.append((fetches.index(tensor), kind, name))

        for name in partition.outputs:
            if plan.transfer(name).swapped:
                fetch(self.producers[name], HOST, name)
        for name in partition.fetches:
            op, index = split_tensor_name(name)
            fetch(f"{prefix}/{op}:{index}" if op in members else _EXTERNAL + name,
                  RESULT, name)
        fetches.append(token + ":0")
        return gate + ":0", feeds, sources, fetches, sinks


def import_plan(graph, plan, scope):
    """Import the plan's partial-run copies under `scope`; its PartialRunGraph."""
    host_copies = partition_rewrite._host_copies(graph, plan, scope)  # pylint: disable=protected-access
    writer = _Writer(graph, plan, host_copies)
    written = [writer.partition(p) for p in plan.partitions]
    stop_gate, stop_done = writer.stop()
    with clean_context(graph):
        with graph.name_scope(f"{scope}/gates/"):  # input_map names tensors, not ops
            for src in sorted(writer.after_originals):
                writer.input_map["^" + _EXTERNAL + src] = gate_after(
                    graph, graph.get_operation_by_name(src))
        tf.graph_util.import_graph_def(writer.graph_def, input_map=writer.input_map,
                                       name=scope + "/")

    def inside(name):
        return f"{scope}/{name}"

    def local(name):  # a name written here, else a tensor of the user's graph
        if name.startswith(_EXTERNAL):
            return name[len(_EXTERNAL):]
        return name if name in writer.fed else inside(name)

    programs = tuple(
        PartialProgram(p.index, inside(gate), tuple(local(f) for f in feeds), tuple(sources),
                       tuple(local(f) for f in fetches), tuple(sinks))
        for p, (gate, feeds, sources, fetches, sinks) in zip(plan.partitions, written))
    return PartialRunGraph(programs, inside(stop_gate), inside(stop_done),
                           tuple(writer.originals))
