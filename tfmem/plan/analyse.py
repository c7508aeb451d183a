"""Analyse: the ops a request needs, as an immutable view free of TensorFlow objects.

`Session.run` prunes the graph to what its fetches and targets need: it walks
data and control inputs backwards and stops at fed tensors.  `analyse` walks
the same way and records every needed op as an `OpNode`, so that grouping,
partitioning and planning are pure functions of plain data:

    fetch  <- MatMul <- Relu <- x (fed: the walk stops here)
                  ^
                  +---- w/read <- w (state source: kept, never copied)

Placeholders reached by the walk were not fed: that is the error `Session.run`
would raise, and it is raised here, before anything runs.  Sources (variables,
tables, queues, iterators and input-free constants; see `optypes`) end the
walk: the partitions map their consumers to the original op.

A stateless op that no needed op reads by a data edge (only through control
edges) and that is neither fetched nor a target is not run: it computes
nothing observable.  This is what TensorFlow's own Grappler dependency
optimizer does inside Session.run, and it matters for memory: a gradient
tuple's control edges would otherwise keep forward activations alive.  Its
control consumers inherit its inputs as control edges, so the order between
stateful ops is unchanged.

A stateful op that reads only sources and feeds (a random op of constant
shape, an iterator's get_next) is an *original*: its partition runs the
user's op itself instead of a copy, so its kernel state (a random stream) is
the one the plain session and every other plan share.  TensorFlow keeps one
kernel per stateful op *name* in a session, so a copy would start a stream of
its own.  A random op (`optypes.RANDOM_STREAM`), or a v2 loop, cond or
function call whose body runs one (TensorFlow inlines the body under the
caller's name), is an original also when it reads computed tensors, such as
dropout's `Shape` of an activation:

    x -> h -> Shape -> RandomUniform (original) -> mask -> ...
         copies         ^ the copy of Shape is connected to its input

Its partition's callable connects the copies' tensors to the op's inputs
(`CallableOptions.tensor_connection`, see `rewrite`), which cuts the op's data
edges the way a feed does, so the copies' values reach the user's op and
nothing upstream of it runs twice.  Control edges cannot be cut that way:
running the user's op runs every op its control edges reach.  Those ops
therefore run as the user's ops too, in the same call (`units` keeps them
together), where they run once, as in plain TensorFlow:

    copies:     h -> Sum           h -> Shape
                       | connected        | connected
    originals:        bump  .......>  RandomUniform     (.......> control edge)

A random op inside a v1 while loop brings its whole outermost loop frame
(Enter ... Exit): the loop runs as the user's ops, the tensors its Enters
read from outside are connected.  A run-bound input (a reference returned by
a v1 variable's update, a stack's or TensorArray's handle) is not connected:
a connection passes a value, so a reference input would refuse it; its
producer runs as the user's op too.  Random ops in v1 cond branches and
after v1 control flow are originals as well: a connected dead tensor is dead
for the user's op too, which then skips its draw exactly as in plain
TensorFlow.
"""

import collections
import dataclasses
import itertools
import types

import tensorflow as tf

from tfmem.plan import optypes
from tfmem.plan import streams as streams_of
from tfmem.errors import UnsupportedGraphError
from tfmem import tf_private


class _cached_property:  # pylint: disable=invalid-name
    """functools.cached_property without its lock (Python 3.11 takes one on every first
    read): planning reads several derived edges of each of 100k ops once.  Like it, it
    stores the value in the instance's __dict__, which later reads find first."""

    def __init__(self, function):
        self.function = function
        self.__doc__ = function.__doc__
        self.name = function.__name__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.function(instance)
        return value


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What planning needs to know of one output tensor."""
    dtype: tf.DType
    shape: tuple | None  # dims (None where unknown), or None for unknown rank

    @_cached_property
    def run_bound(self):
        """Whether the tensor dies with its run (read for every output when grouping; the
        tensors of a request share few TensorInfos)."""
        return optypes.is_run_bound(self.dtype)

    @_cached_property
    def nbytes(self):
        """Bytes of a fixed-size tensor of fully known shape, else None (found once: the
        planners ask for every crossing of every candidate plan)."""
        return tensor_bytes(self.dtype, self.shape)


def tensor_bytes(dtype, shape):
    """Bytes of a tensor of fixed-size `dtype` and fully known `shape`, else None.

    The one byte count of tfmem: planning, the simulator and the plan's JSON use it.
    """
    if shape is None or None in shape or not optypes.has_fixed_size(dtype):
        return None
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.size


@dataclasses.dataclass(frozen=True)
class OpNode:
    """One needed op: its edges by name and its outputs."""
    name: str
    type: str
    inputs: tuple  # tensor names, "op:index"
    control_inputs: tuple  # op names
    outputs: tuple  # TensorInfo per output index
    stateful: bool
    side_effects: bool  # stateful, or reads a reference or resource it may write through
    frame: str | None = None  # frame_name of a v1 Enter op
    device: str = ""  # the device the graph requests for the op
    state_bytes: int = 0  # bytes of the variable a state source holds, when its shape is known
    # The type Grappler's arithmetic optimizer gives the op before it regroups, where it
    # is not `type`: "Mul" for a power of 3 (x ** 3 becomes x * square(x)).
    arithmetic_type: str = ""

    # Edges by op, derived once: the simulator and the planners walk them for every
    # candidate plan.
    @_cached_property
    def input_ops(self):
        """The op that produces each data input, in input order."""
        return tuple([t.rpartition(":")[0] for t in self.inputs])

    @_cached_property
    def input_indices(self):
        """The output index of each data input, in input order."""
        return tuple(split_tensor_name(t)[1] for t in self.inputs)

    @_cached_property
    def data_producers(self):
        """The ops whose outputs this op reads, as a set."""
        return frozenset(self.input_ops)

    @_cached_property
    def output_names(self):
        """The names of its output tensors, "op:index"."""
        return tuple(f"{self.name}:{index}" for index in range(len(self.outputs)))

    @_cached_property
    def producers(self):
        """The ops this op waits for (data producers, then control inputs), without repeats."""
        return tuple(dict.fromkeys(self.input_ops + tuple(self.control_inputs)))


@dataclasses.dataclass(frozen=True)
class GraphView:
    """The pruned subgraph of one request.

    `nodes` are the ops partitions will run, in discovery order; those in
    `originals` run as the user's op, the others as copies.  `sources` are
    the state sources and constants they read, and `feeds` the fed tensors;
    both stay outside the partitions.
    """
    nodes: types.MappingProxyType  # op name -> OpNode
    originals: frozenset  # stateful nodes run as the user's own op
    sources: types.MappingProxyType  # op name -> OpNode
    feeds: frozenset  # fed tensor names (all of the request's feeds)
    fetches: tuple  # tensor names
    targets: tuple  # op names
    # Whether the session that runs the request runs Grappler's arithmetic optimizer,
    # which reorders sums (units.py, rule 5); run/compiling/regrouping.py reads it off the config.
    regrouped_arithmetic: bool = True
    # Whether Grappler's dependency optimizer runs there, removing IdentityN ops whose
    # outputs stay in a partition (op_order.dissolved_identities); run/compiling/regrouping.py
    # reads it off the config.
    removes_identities: bool = True
    # Whether the runner chains each partition's copies in one order (TFMemSession does,
    # tfmem.function does not); the simulator then counts that order (op_order).
    chained: bool = False

    @_cached_property
    def readers(self):
        """{tensor: the nodes that read it, in node order}: every candidate plan's
        transfers come from these edges."""
        readers, more = {}, {}  # more: the tensors read more than once, their readers so far
        for name, node in self.nodes.items():
            for tensor in node.inputs:
                first = readers.get(tensor)
                if first is None:
                    readers[tensor] = (name,)
                elif tensor in more:
                    more[tensor].append(name)
                else:
                    more[tensor] = [*first, name]
        for tensor, names in more.items():
            readers[tensor] = tuple(names)
        return readers

    @_cached_property
    def node_index(self):
        """{node: its position in `nodes`}: the planners' integer graphs (`waits`) name
        nodes by it."""
        return {name: i for i, name in enumerate(self.nodes)}

    @_cached_property
    def waits(self):
        """Per node, in `nodes` order, the positions of the nodes it waits for by data or
        control (`OpNode.producers` inside the view): grouping and ordering walk these
        integer edges rather than names."""
        get, waits = self.node_index.get, []
        for node in self.nodes.values():
            ops = node.input_ops + node.control_inputs if node.control_inputs else \
                node.input_ops
            srcs = [i for i in map(get, ops) if i is not None]
            waits.append(list(dict.fromkeys(srcs)) if len(srcs) > 1 else srcs)
        return tuple(waits)

    @_cached_property
    def control_flow(self):
        """{node: its type} of the v1 control-flow nodes (`optypes.CONTROL_FLOW`), which
        grouping and ordering treat apart; empty for most requests."""
        flow = optypes.CONTROL_FLOW
        return {name: node.type for name, node in self.nodes.items() if node.type in flow}

    @_cached_property
    def computed_reads(self):
        """((tensor, producing node, its readers, whether the producer reads state), ...) of
        every computed tensor a node reads, fed ones left out: the edges that cross when a
        plan puts producer and reader in different partitions (build.Slicing)."""
        edges, feeds, nodes, sources = [], self.feeds, self.nodes, self.sources
        for tensor, names in self.readers.items():
            producer = tensor.rpartition(":")[0]
            node = nodes.get(producer)
            if node is None or tensor in feeds:
                continue
            edges.append((tensor, producer, names, node.type in optypes.STATE_READS and
                          optypes.reads_state(node, sources)))
        return tuple(edges)

    @_cached_property
    def outside_reads(self):
        """({node: ((tensor, op), ...) of its data inputs that are fed or read a source},
        {original: ((tensor, op), ...) of the fed placeholders its control inputs name}):
        what a partition must feed or map to the original (build.Slicing)."""
        data, controls = {}, {}
        feeds, sources = self.feeds, self.sources
        outside = feeds | sources.keys()  # tensor and op names: an op's name has no ':'
        for name, node in self.nodes.items():
            if outside.isdisjoint(node.inputs) and outside.isdisjoint(node.input_ops):
                pairs = ()  # most nodes: every input computed by another node
            else:
                pairs = [(t, op) for t, op in zip(node.inputs, node.input_ops)
                         if t in feeds or op in sources]
            if pairs:
                data[name] = tuple(pairs)
            if name in self.originals:
                fed = tuple((src + ":0", src) for src in node.control_inputs
                            if src + ":0" in self.feeds)
                if fed:
                    controls[name] = fed
        return data, controls

    def tensor(self, name):
        """TensorInfo of a tensor produced by a node or a source."""
        op_name, index = split_tensor_name(name)
        node = self.nodes.get(op_name) or self.sources[op_name]
        return node.outputs[index]


def split_tensor_name(name):
    op_name, _, index = name.rpartition(":")
    return op_name, int(index)


def canonical_input(name):
    """A NodeDef's data input as a tensor name ("op" reads "op:0")."""
    return name if ":" in name else name + ":0"


def control_inputs(op, listed=None):
    """`op`'s control inputs in the order its NodeDef lists them (the order they were
    added).  `op.control_inputs` follows TensorFlow's in-edge set, ordered by memory
    address: the same graph built twice lists them differently, and the walk (so the
    view, the plan and its prediction) would differ from process to process.
    `listed`: `op.control_inputs`, when the caller has it."""
    listed = op.control_inputs if listed is None else listed
    if len(listed) < 2:
        return listed
    if tf_private.is_function_graph(op.graph):
        # A trace's automatic control dependencies add them from a set, in an order
        # that changes with the process's string hashing: creation order is stable.
        return sorted(listed, key=tf_private.creation_index)
    by_name = {c.name: c for c in listed}
    return [by_name[i[1:]] for i in op.node_def.input if i.startswith("^") and i[1:] in by_name]


def _node(op, stateful_types, controls=(), name=None, kind=None, infos=None, inputs=None):
    """The OpNode of `op`; `stateful_types` caches OpDef.is_stateful by op type;
    `controls`: `control_inputs(op)`; `name`, `kind`, `inputs`: `op.name`, `op.type`,
    `op.inputs`, when the caller has them (each read is a call into TensorFlow's C
    API); `infos`: the TensorInfos the request's tensors share, by (id(dtype), shape),
    and (dtype, whether it is run-bound) by id(dtype): hashing a DType is a call into
    TensorFlow, and the values keep each dtype, so its id is not reused.
    Written for speed: analyse makes one per op of a 100k-op request."""
    kind = op.type if kind is None else kind
    frame = None
    if kind in optypes.ENTER:
        frame = op.get_attr("frame_name")
        frame = frame.decode() if isinstance(frame, bytes) else frame
    stateful = stateful_types.get(kind)
    if stateful is None:
        stateful = stateful_types[kind] = op.op_def.is_stateful
    inputs = op.inputs if inputs is None else inputs
    infos = {} if infos is None else infos
    outputs = []
    for tensor in op.outputs:  # the C shape: a TensorShape per tensor costs more
        dims, unknown_rank = tf_private.static_shape(tensor)
        dtype = tensor.dtype
        shape = None if unknown_rank else tuple(dims)
        info = infos.get((id(dtype), shape))
        if info is None:
            info = infos[id(dtype), shape] = TensorInfo(dtype, shape)
        outputs.append(info)
    side_effects = stateful
    if not stateful:
        for tensor in inputs:
            dtype = tensor.dtype
            bound = infos.get(id(dtype))
            if bound is None:
                bound = infos[id(dtype)] = (dtype, optypes.is_run_bound(dtype))
            if bound[1]:
                side_effects = True
                break
    names = tuple([t.name for t in inputs])
    node = _op_node(
        name=op.name if name is None else name,
        type=kind,
        inputs=names,
        control_inputs=tuple([c.name for c in controls]) if controls else (),
        outputs=tuple(outputs),
        stateful=stateful,
        side_effects=side_effects,
        frame=frame,
        device=op.device,
        state_bytes=_variable_bytes(op) if kind in optypes.VARIABLES else 0,
        arithmetic_type=_arithmetic_type(op) if kind == "Pow" else "",
    )
    # the walk goes on by these names (see OpNode.input_ops)
    node.__dict__["input_ops"] = tuple([t.rpartition(":")[0] for t in names])
    return node


def _op_node(**fields):
    """OpNode(**fields), every field given, without the frozen dataclass's __init__ (one
    object.__setattr__ per field): analyse makes one per op of a 100k-op request."""
    if fields.keys() != _OP_NODE_FIELDS:
        raise TypeError(f"OpNode fields {sorted(fields)} are not {sorted(_OP_NODE_FIELDS)}")
    node = object.__new__(OpNode)
    node.__dict__.update(fields)
    return node


_OP_NODE_FIELDS = frozenset(field.name for field in dataclasses.fields(OpNode))


def _arithmetic_type(op):
    """OpNode.arithmetic_type: Grappler rewrites a `Pow` whose exponent is a constant
    3 into a product on the CPU, which then joins a chain of products (rule 5 of
    plan/units.py) and has constants multiplied into it there."""
    if op.type != "Pow" or op.inputs[1].op.type != "Const":
        return ""
    exponent = tf.make_ndarray(op.inputs[1].op.get_attr("value"))
    return "Mul" if exponent.size and (exponent == 3).all() else ""


def _variable_bytes(op):
    """Size of the variable a VarHandleOp / VariableV2 holds, or 0 when unknown.  Read
    off its NodeDef once (get_attr parses the NodeDef's attributes at each call)."""
    if op.type not in optypes.VARIABLES or op.type == "_VarHandlesOp":  # one shape attr
        return 0
    attrs = op.node_def.attr
    shape = attrs["shape"].shape
    if shape.unknown_rank or any(dim.size < 0 for dim in shape.dim):
        return 0
    count = 1
    for dim in shape.dim:
        count *= dim.size
    return count * tf.as_dtype(attrs["dtype"].type).size


def _unfed_placeholder_error(op):
    tensor = op.outputs[0]
    shape = "<unknown>" if tensor.shape.rank is None else (
        "[" + ",".join("?" if d is None else str(d) for d in tensor.shape.as_list()) + "]")
    return tf.errors.InvalidArgumentError(
        op.node_def, op,
        f"You must feed a value for placeholder tensor '{op.name}' with dtype "
        f"{tensor.dtype.name} and shape {shape}")


def _drop_unobservable(nodes, keep):
    """Remove stateless ops only control edges need; pass their inputs on as control edges."""
    # how many nodes read each op's outputs (counted in C: every data edge of the request)
    data_readers = collections.Counter(itertools.chain.from_iterable(
        node.input_ops for node in nodes.values()))
    control_readers = {}  # op -> the nodes with a control edge from it, for ops that have any
    controlled = [name for name, node in nodes.items() if node.control_inputs]
    for name in controlled:
        for src in nodes[name].control_inputs:
            if src in nodes:
                readers = control_readers.get(src)
                if readers is None:
                    control_readers[src] = {name}
                else:
                    readers.add(name)
    control = {}  # node -> its control inputs as removals edit them, for the nodes edited

    def control_of(name):
        edges = control.get(name)
        if edges is None:
            edges = control[name] = dict.fromkeys(nodes[name].control_inputs)
        return edges

    def removable(name):
        node = nodes[name]
        if name in keep or node.side_effects or data_readers.get(name) or \
                node.type in optypes.CONTROL_FLOW:
            return False
        return not any(p in nodes and nodes[p].type in optypes.CONTROL_FLOW
                       for p in node.input_ops)

    removed = set()
    pending = [name for name in nodes if name not in data_readers and removable(name)]
    while pending:
        name = pending.pop()
        if name in removed or not removable(name):
            continue
        removed.add(name)
        data_sources = [p for p in nodes[name].input_ops if p in nodes]
        producers = list(dict.fromkeys(data_sources +
                                       [c for c in control_of(name) if c in nodes]))
        for reader in control_readers.get(name, ()):
            if reader in removed:
                continue
            edges = control_of(reader)
            edges.pop(name, None)
            for src in producers:
                if src != reader and src not in removed:
                    edges[src] = None
                    control_readers.setdefault(src, set()).add(reader)
        for src in data_sources:
            data_readers[src] -= 1
        for src in producers:
            control_readers.get(src, set()).discard(name)
            pending.append(src)
    kept = {name: node for name, node in nodes.items() if name not in removed} if removed \
        else dict(nodes)
    for name in controlled:  # the nodes removals edited are among them
        if name in removed:
            continue
        node = nodes[name]
        edges = tuple([c for c in control.get(name, node.control_inputs) if c in nodes])
        if edges != node.control_inputs:
            kept[name] = _with_control_inputs(node, edges)
    return kept


def _with_control_inputs(node, edges):
    """`dataclasses.replace(node, control_inputs=edges)` without the frozen dataclass's
    __init__, keeping the derived data edges found already (`producers` is found again):
    dropping ops edits the control inputs of a sixth of a training step's ops."""
    copy = object.__new__(OpNode)
    copy.__dict__.update(node.__dict__)
    copy.__dict__["control_inputs"] = edges
    copy.__dict__.pop("producers", None)
    return copy


def _run_together(nodes, sources, fed, frames, draw):
    """The ops that run as the user's ops with the random op `draw`, or None if they cannot.

    Running the user's op runs every op its control edges reach, and a control
    edge cannot be cut: each such op joins (sources are idempotent; a fed
    placeholder is fed to the call).  A member inside a v1 while loop brings
    its outermost frame (`frames`: op -> frame, frame -> ops): the loop runs
    as the user's ops, the inputs of its Enters connected.  A run-bound input
    (a reference, a handle) is not connected (a connection passes a value,
    which a reference input refuses): its producer joins.  Other data inputs
    are connected.
    """
    frame_of, frame_ops = frames
    members, stack = set(), [draw]
    while stack:
        name = stack.pop()
        if name in members:
            continue
        members.add(name)
        node = nodes[name]
        if name in frame_of:
            stack.extend(frame_ops[frame_of[name]])
        for src in node.control_inputs:
            if src in nodes:
                stack.append(src)
            elif src not in sources and src + ":0" not in fed:
                return None  # not reached by analysis: cannot happen for a valid request
        for tensor in node.inputs:
            producer, index = split_tensor_name(tensor)
            if producer in nodes and tensor not in fed and \
                    nodes[producer].outputs[index].run_bound:
                stack.append(producer)
    return members


def _drawing_together(nodes, sources, fed, draws):
    """Every op that runs as the user's op because a random op needs it (`_run_together`)."""
    frames = ({}, {})
    if any(node.type in optypes.ENTER for node in nodes.values()):
        frame_of = streams_of.loop_frames(nodes)
        frame_ops = {}
        for name, frame in frame_of.items():
            frame_ops.setdefault(frame, []).append(name)
        frames = (frame_of, frame_ops)
    together = set()
    for draw in draws:
        if draw not in together:
            together |= _run_together(nodes, sources, fed, frames, draw) or set()
    return together


def _keep_fed_waits(nodes, walked, together, fed):
    """Give back the control edges from fed placeholders that dropping took from the ops run
    together with a random op: running the user's op needs them fed (see `build`)."""
    for name in together:
        if name not in nodes:
            continue
        waits = tuple(src for src in walked[name].control_inputs
                      if src not in walked and src + ":0" in fed
                      and src not in nodes[name].control_inputs)
        if waits:
            nodes[name] = dataclasses.replace(
                nodes[name], control_inputs=nodes[name].control_inputs + waits)
    return nodes


def _originals(nodes, sources, fed, control_on_sources, together):
    """The nodes that run as the user's own op (see the module docstring)."""
    def reads_given(node):
        return all(t in fed or split_tensor_name(t)[0] in sources for t in node.inputs)

    given = [name for name, node in nodes.items()
             if node.stateful and name in control_on_sources and reads_given(node)]
    return frozenset(given) | frozenset(name for name in together if name in nodes)


def analyse(fetch_tensors, target_ops, fed_tensors, regrouped_arithmetic=True, chained=False,
            removes_identities=True):
    """The GraphView of the ops `Session.run(fetches + targets)` would run.

    `regrouped_arithmetic`: False when the session runs no Grappler arithmetic
    optimizer; its sums then add in input order and need not stay whole (units.py).
    `removes_identities`: False when it runs no Grappler dependency optimizer (op_order).
    `chained`: True for a runner that chains each partition's copies in one order
    (op_order.chained_order).
    """
    fed = frozenset(t.name for t in fed_tensors)
    nodes, sources, stateful_types, infos = {}, {}, {}, {}
    control_on_sources = set()  # ops whose own control inputs are all state sources
    draws = set()  # ops whose kernels keep random streams
    seen = set()  # ops walked, as objects: reading an op's name is a call into the C API
    # (op, its name): a name comes with the edge that reached the op, as its reader has it
    stack = [(op, op.name) for op in reversed(target_ops)] + \
        [(t.op, t.op.name) for t in reversed(fetch_tensors)]
    while stack:
        op, name = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        kind = op.type
        if kind in optypes.PLACEHOLDERS:
            raise _unfed_placeholder_error(op)
        inputs = op.inputs
        # a source reads nothing, or is a state source (which must not read anything)
        if (not inputs or kind in optypes.STATE_SOURCES) and optypes.is_source(op, kind):
            if inputs or op.control_inputs:
                raise UnsupportedGraphError(
                    f"State op '{name}' ({kind}) has inputs; tfmem maps every "
                    "use of a state op to the original and cannot re-run its inputs. "
                    "Create the variable/table/queue outside control_dependencies.")
            sources[name] = _node(op, stateful_types, name=name, kind=kind, infos=infos,
                                  inputs=inputs)
            continue
        controls = op.control_inputs
        if len(controls) > 1:  # most ops have at most one: no order to restore
            controls = control_inputs(op, controls)
        node = nodes[name] = _node(op, stateful_types, controls, name, kind, infos, inputs)
        if not controls or all(optypes.is_source(c) for c in controls):
            control_on_sources.add(name)
        if (kind in optypes.RANDOM_STREAM or kind in optypes.STATEFUL_CALLS) and \
                optypes.draws_random_stream(op, kind):
            draws.add(name)
        # Visit inputs in order: push in reverse so the first input is walked first
        # (an op walked already would be passed over when popped).
        pending = [(producer, src) for producer, src, tensor
                   in zip([t.op for t in inputs], node.input_ops, node.inputs)
                   if tensor not in fed and producer not in seen]
        if controls:
            pending += [(c, src) for c, src in zip(controls, node.control_inputs)
                        if c not in seen and
                        not (c.type in optypes.PLACEHOLDERS and c.outputs[0].name in fed)]
        stack.extend(reversed(pending))
    keep = {t.op.name for t in fetch_tensors} | {op.name for op in target_ops}
    together = _drawing_together(nodes, sources, fed, draws)
    nodes = _keep_fed_waits(_drop_unobservable(nodes, keep | together), nodes, together, fed)
    originals = _originals(nodes, sources, fed, control_on_sources, together)
    return GraphView(
        nodes=types.MappingProxyType(nodes),
        originals=originals,
        sources=types.MappingProxyType(sources),
        feeds=fed,
        fetches=tuple(t.name for t in fetch_tensors),
        targets=tuple(op.name for op in target_ops),
        regrouped_arithmetic=bool(regrouped_arithmetic),
        removes_identities=bool(removes_identities),
        chained=bool(chained),
    )
