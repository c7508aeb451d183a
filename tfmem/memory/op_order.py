"""The orders a partition's ops may run in, for the simulator.

A step's peak depends on the order its ops run in, and TensorFlow does not walk
a graph depth first.  Its executor (`ExecutorState::ProcessInline` and
`ScheduleReady` in executor.cc) works through the ops each finished op makes
ready, in the order of that op's output edges, data edges first:

- an inexpensive kernel goes to the running thread's inline queue, first in
  first out;
- of the expensive ones, the last stays on the thread when its inline queue is
  empty; the others go to the inter-op pool, whose worker takes the task it
  pushed last first (Eigen's pool pushes a worker's own tasks at the front of
  its queue).  The step's first ops (state, feeds) are pushed from outside,
  at the back, in node order.

Every kernel starts out expensive (a cost estimate of 1e8 cycles that decays by
a tenth each time it runs, against a threshold of a few thousand) except those
that declare themselves cheap (`INEXPENSIVE`): for the first ninety-odd steps
that is the rule; later, kernels that measure cheap run inline too
(DeepSpeech's peak moved by 2 % at step 93).

Output edges iterate in the order they were added, which follows node ids, up
to eight of them; beyond, in a hash order of the edges' addresses.  So an op
with many readers (a loss's gradient reaching every frame, a weight read by
every frame) makes them ready in an order that changes from process to
process, one reason the same plan measures differently in two processes.
Node ids follow TensorFlow's numbering of a GraphDef (`_node_ids`); constant
folding turns ops computed from constants alone into new nodes
(`folded_constants`); both match the graph TensorFlow ran for DeepSpeech
(tests/test_memory_model.py).  Under TensorFlow's default session config
Grappler rewrites the graph further.

So the simulator does not bet on one order: `candidate_orders` are the plan's
depth-first order and the executor emulated with each op's readers in node-id
order and reversed, on one thread and, where the device has more inter-op
threads (`concurrent_ops`), on that many taking turns, and on that many while
a long kernel (`LONG_KERNELS`: a convolution, a matrix product, their
gradients) holds its thread until the others have nothing left to run; the
simulator counts the worst.  DeepSpeech at 32
frames (batch 128, one partition, one thread per pool, the request's state
included) measures 19.7-20.0 MiB in five processes, and 19.9-20.2 simulated in
the order each process's trace recorded; the emulated executor predicts 21.8,
depth first 16.3: the backward pass runs as a wave across all frames, not
frame by frame (tests/test_memory_model.py checks the wave).

Where the order is tfmem's to fix, it is fixed: TFMemSession chains each
partition's copies in the depth-first order by control edges
(`chained_order`), and the simulator counts that order alone
(`partition_orders`).
"""


import collections
import heapq

from tfmem.plan import optypes

# Kernels whose IsExpensive() is false: TensorFlow runs them inline, at once.
INEXPENSIVE = frozenset({
    "Identity", "IdentityN", "StopGradient", "PreventGradient", "Snapshot", "Const",
    "Reshape", "Squeeze", "ExpandDims", "Shape", "ShapeN", "Size", "Rank", "NoOp",
    "ControlTrigger", "Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge",
    "RefMerge", "NextIteration", "RefNextIteration", "LoopCond", "ReadVariableOp",
    "VarHandleOp", "VariableV2", "StridedSliceGrad",
})
# Kernels that take far longer than an elementwise op on tensors of their size: while one
# runs, another inter-op thread may run a whole branch of small ops (Keras Adam's
# thousands of update ops on ResNet-50 beside the last convolution gradients).
LONG_KERNELS = frozenset({
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
    "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter",
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "MaxPoolGrad",
    "MaxPool3DGrad", "AvgPoolGrad", "FusedBatchNormV3", "FusedBatchNormGradV3",
})
_BACK_EDGES = ("NextIteration", "RefNextIteration")  # a loop's: not waited for
_VALUE_VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims"})  # folded too


class _Edges:
    """The edges inside one partition, found once for the orders made of it: per op how
    many of its producers are in the partition and its readers there (a loop's back
    edges left out), and the ops that read a tensor from outside it that is no state
    (a feed, another partition's output).

    `dissolved`: IdentityN ops Grappler removes (`dissolved_identities`): a reader of
    one waits for the producer of the input it reads through it (a control reader, for
    all of them), and the IdentityN waits for nothing and makes nothing ready."""

    def __init__(self, view, ops, dissolved=frozenset()):
        members = set(ops)
        nodes = view.nodes
        self.dissolved = dissolved
        self.waiting = {name: 0 for name in ops}
        self.readers = {name: [] for name in ops}
        self.reads_fed = []
        # {op reading a dissolved IdentityN: its (tensor, producer) inputs, rewired}
        self.inputs = {}
        self.producers = {}  # {op reading a dissolved IdentityN: its producers, rewired}
        for name in ops:
            if name in dissolved:
                continue
            node = nodes[name]
            producers = node.producers
            if dissolved and not dissolved.isdisjoint(producers):
                producers = self.producers[name] = self._rewired(view, node, dissolved)
            fed = False
            for src in producers:
                if src in members:
                    if nodes[src].type not in _BACK_EDGES:
                        self.waiting[name] += 1
                        self.readers[src].append(name)
                elif src not in view.sources:
                    fed = True
            if fed:
                self.reads_fed.append(name)

    def _rewired(self, view, node, dissolved):
        """`node`'s producers with each dissolved IdentityN replaced by what it stood for;
        its rewired data inputs go to `self.inputs`."""
        inputs = []
        for tensor, op, index in zip(node.inputs, node.input_ops, node.input_indices):
            while op in dissolved:  # an IdentityN of an IdentityN goes too
                tensor = view.nodes[op].inputs[index]
                op, index = view.nodes[op].input_ops[index], view.nodes[op].input_indices[index]
            inputs.append((tensor, op))
        self.inputs[node.name] = tuple(inputs)
        controls = []
        for op in node.control_inputs:
            controls.extend(view.nodes[op].producers if op in dissolved else (op,))
        return tuple(dict.fromkeys([op for _, op in inputs] + controls))

    def producers_of(self, view, name):
        """The ops `name` waits for, rewired where it was (none for a dissolved one)."""
        if name in self.dissolved:
            return ()
        rewired = self.producers.get(name)
        return view.nodes[name].producers if rewired is None else rewired

    def inputs_of(self, view, name):
        """(tensor, producer) of each data input of `name`, rewired where it was."""
        rewired = self.inputs.get(name)
        if rewired is not None:
            return rewired
        node = view.nodes[name]
        return tuple(zip(node.inputs, node.input_ops))


# What Grappler's dependency optimizer never removes an IdentityN after: a variable
# (`SafeToRemoveIdentity` in dependency_optimizer.cc keeps the identity of a variable's
# value; its op types.cc counts a resource variable's read as a variable).
_VARIABLE_TYPES = frozenset({"Variable", "VariableV2", "AutoReloadVariable", "VarHandleOp",
                             "ReadVariableOp", "_VarHandlesOp", "_ReadVariablesOp"})


def dissolved_identities(view, ops):
    """The IdentityN ops of a partition of `ops` that Grappler's dependency optimizer
    removes before it runs, wiring each reader to the input it stood for: those whose
    outputs are all read inside the partition (none a return value or a fetch: Grappler
    keeps an IdentityN that a return value reads), that are no target, and whose first
    input is no variable (`view.removes_identities`: only where the optimizer runs).

    Keras's optimizers pass every gradient through one IdentityN.  Kept, it would hold
    each variable's update arithmetic until the step's last gradient; removed, the
    executor runs each as soon as its own gradient is there, beside the last gradients'
    kernels: TensorFlow's profiler found 180 MiB of Adam's results alive at the peak of
    the last backward partition of a Keras ResNet-50 at batch 512."""
    if not view.removes_identities:
        return frozenset()
    members = set(ops)
    nodes, sources, readers = view.nodes, view.sources, view.readers
    ends = {tensor.rpartition(":")[0] for tensor in view.fetches} | set(view.targets)
    dissolved = set()
    for name in ops:
        node = nodes[name]
        if node.type != "IdentityN" or not node.inputs or name in ends:
            continue
        first = nodes.get(node.input_ops[0]) or sources.get(node.input_ops[0])
        if first is None or first.type in _VARIABLE_TYPES:
            continue
        if all(reader in members for tensor in node.output_names
               for reader in readers.get(tensor, ())):
            dissolved.add(name)
    return frozenset(dissolved)


def _edges(view, ops, folded=frozenset(), edges=None):
    """({op: how many of its producers are in `ops`}, {op: its readers in `ops`}); ops
    `folded` into constants wait for nothing.  `edges`: the `_Edges` of `ops`, when the
    caller has them."""
    edges = edges or _Edges(view, ops)
    waiting = dict(edges.waiting)
    if not folded:
        return waiting, edges.readers
    for name in folded:
        waiting[name] = 0
    return waiting, {name: [reader for reader in readers if reader not in folded]
                     for name, readers in edges.readers.items()}


def folded_constants(view, ops, depth_first=None):
    """The ops TensorFlow's constant folding replaces by a Const before the step runs:
    stateless ops whose every producer is a constant or folded (a loss's gradient seed,
    ones shaped like a scalar loss, scaled by the constant batch size).  `depth_first`:
    `dependency_order(view, ops)`, when the caller has it."""
    folded = set()
    nodes, sources = view.nodes, view.sources
    for name in depth_first or dependency_order(view, ops):
        node = nodes[name]
        if node.side_effects or (node.type in INEXPENSIVE and node.type not in _VALUE_VIEWS):
            continue
        producers = node.producers
        if not producers:
            continue
        for producer in producers:  # most ops read an op that is neither: stop there
            if producer not in folded and (producer not in sources
                                           or sources[producer].type != "Const"):
                break
        else:
            folded.add(name)
    return folded


# Originals (the user's ops, which are not copied and so not chained) whose place in
# the order does not move a peak: a variable's read allocates nothing.
_ORDER_FREE_ORIGINALS = frozenset({"ReadVariableOp"})


def chained_order(view, ops):
    """The order a runner that chains copies (`view.chained`) runs a partition's ops in,
    each copy waiting for the one before by a control edge; None where TensorFlow's
    executor picks the order: a partition with v1 control flow (a control edge cannot
    enter a loop frame) or with an original that allocates (a random draw, a dequeue).
    In one fixed order a step's peak is one figure in every process."""
    return dependency_order(view, ops) if is_chained(view, ops) else None


def is_chained(view, ops):
    """Whether the runner chains a partition of `ops` (see `chained_order`)."""
    if not view.chained:
        return False
    for op in ops:
        kind = view.nodes[op].type
        if kind in optypes.CONTROL_FLOW or (op in view.originals
                                            and kind not in _ORDER_FREE_ORIGINALS):
            return False
    return True


def partition_orders(view, ops, originals=frozenset(), threads=1):
    """The orders the simulator tries for a partition, the worst counting: its only
    order where it has one (`_only_order`), the chained order alone where the runner
    chains the partition, else `candidate_orders` with `threads` inter-op threads.  An
    iterator, each order made when it is asked for: a search that rejects a candidate on
    the first order's peak emulates no executor."""
    order = _only_order(view, ops)
    if order is not None:  # whatever runs it
        yield order
        return
    order = chained_order(view, ops)
    if order is not None:
        yield order
    else:
        yield from candidate_orders(view, ops, originals, threads)


def _only_order(view, ops):
    """The one order a partition's ops can run in, where each reads the one before it,
    none is v1 control flow and none is folded to a constant (which the executor would
    run last), else None.
    Near a budget's limit most partitions are one or two ops: no executor to emulate."""
    if len(ops) > 1:
        nodes = view.nodes
        if any(before not in nodes[name].producers for before, name in zip(ops, ops[1:])) \
                or any(nodes[name].type in optypes.CONTROL_FLOW for name in ops) \
                or folded_constants(view, ops, ops):
            return None
    return list(ops)


def candidate_orders(view, ops, originals=frozenset(), threads=1):
    """The orders the simulator tries, the worst counting: the plan's (depth first), and
    the executor's with each op's readers in node-id order and reversed, on one thread
    and, with `threads` above one, on that many (an iterator)."""
    edges = _Edges(view, ops)
    depth_first = dependency_order(view, ops, edges=edges)
    yield depth_first
    yield from executor_orders(view, ops, originals, depth_first, threads, edges)


def executor_orders(view, ops, originals=frozenset(), depth_first=None, threads=1,
                    edges=None):
    """The partition's ops in the order TensorFlow's executor runs them with one inter-op
    thread (see the module docstring), with each op's readers in the order of their node
    ids, then with them reversed (an iterator); ops in a cycle, which it never runs, last.
    With `threads` above one, the same two again as `threads` threads interleave them
    (`_executor_order`).  `depth_first`: `dependency_order(view, ops)`, and `edges`: the
    `_Edges` of `ops`, when the caller has them."""
    dissolved = dissolved_identities(view, ops)
    if dissolved:
        edges = _Edges(view, ops, dissolved)
    edges = edges or _Edges(view, ops)
    folded = folded_constants(view, ops, depth_first)
    node_id = _node_ids(view, ops, originals, edges)
    waiting, readers = _edges(view, ops, folded, edges)
    outside, roots = _step_start(view, ops, folded, node_id, waiting, edges)
    inexpensive = frozenset(name for name in ops if view.nodes[name].type in INEXPENSIVE)
    by_direction = {}  # the edges are the same four times: each direction sorted once
    for workers in sorted({1, max(int(threads), 1)}):
        for reversed_readers in (False, True):
            if reversed_readers not in by_direction:
                by_direction[reversed_readers] = _readers_in_turn(view, readers, node_id,
                                                                  reversed_readers)
            yield _executor_order(ops, dict(waiting), by_direction[reversed_readers], outside,
                                  roots, inexpensive, workers)
    long_kernels = frozenset(name for name in ops if view.nodes[name].type in LONG_KERNELS)
    if threads > 1 and long_kernels:
        for reversed_readers in (False, True):
            yield _executor_order(ops, dict(waiting), by_direction[reversed_readers], outside,
                                  roots, inexpensive, int(threads), long_kernels)


def _readers_in_turn(view, readers, node_id, reversed_readers):
    """{op: its readers in the order the executor makes them ready}: data readers before
    control readers, each by node id (or reversed)."""
    sign = -1 if reversed_readers else 1
    nodes = view.nodes
    in_turn = {}
    for producer, names in readers.items():
        if len(names) < 2:
            in_turn[producer] = names
        else:
            in_turn[producer] = sorted(
                names, key=lambda reader: (producer not in nodes[reader].data_producers,
                                           sign * node_id[reader]))
    return in_turn


def _step_start(view, ops, folded, node_id, waiting, edges):
    """({op outside the partition: its readers in it}, the step's first ops in the order
    they are pushed); `waiting` counts the outside producers too, after.

    The step's first ops produce what the partition reads from outside: state (the
    user's nodes, numbered first), feeds and other partitions' results (arguments
    TensorFlow adds to the graph), and the constants folding made (the last nodes)."""
    outside = {}
    for name in ops:
        if name in folded:
            continue
        for src in edges.producers_of(view, name):
            if src not in waiting:
                outside.setdefault(src, []).append(name)
                waiting[name] += 1
    roots = [((src not in view.sources, node_id[first[0]]), src)
             for src, first in outside.items()]
    roots += [((0, node_id[name]), name) for name in ops
              if waiting[name] == 0 and name not in folded]
    roots += [((2, node_id[name]), name) for name in ops if name in folded]
    return outside, tuple(root for _, root in sorted(roots))


def _executor_order(ops, waiting, readers, outside, roots, inexpensive, workers=1,
                    long_kernels=frozenset()):
    """The executor's order with `workers` inter-op threads, each running one op in turn;
    `waiting` ({op: producers not yet run}) is used up.

    Two threads work on two branches at once: a gradient reaching two batch
    normalizations makes both branches' readers ready, one thread keeps one and the
    other takes the next from the pool, so both branches' intermediates are alive
    together (two branches holding 16 MiB each peak at 32 MiB, where one thread's
    orders count 16: tests/test_branches_at_once.py).  Taking turns op by op is the
    even interleaving of kernels that take as long as each other.

    An op of `long_kernels` holds its thread while the other threads run all they can;
    it ends (enters the order, its readers made ready) when none can run anything else,
    the one that started first first.  So the small ops beside it run before it ends,
    their results held while it and its readers run (tests/test_long_kernels.py)."""
    pool = collections.deque(roots)
    order = []
    inlines = [collections.deque() for _ in range(workers)]
    running = [None] * workers  # each thread's long kernel, with when it started
    started = 0
    while pool or any(inlines) or any(running):
        ran = False
        for thread, inline in enumerate(inlines):
            if running[thread] is not None:
                continue
            while not inline and pool:  # an idle thread takes the pool's next task
                first = pool.popleft()
                if first in waiting:
                    inline.append(first)
                if first in outside:
                    _make_ready(inexpensive, outside[first], waiting, inline, pool)
            if inline:
                name = inline.popleft()
                ran = True
                if name in long_kernels:
                    running[thread] = (started, name)
                    started += 1
                    continue
                order.append(name)
                _make_ready(inexpensive, readers[name], waiting, inline, pool)
        if not ran and any(running):  # nothing else can run: the oldest long kernel ends
            thread = min((t for t in range(workers) if running[t] is not None),
                         key=lambda t: running[t][0])
            name = running[thread][1]
            running[thread] = None
            order.append(name)
            _make_ready(inexpensive, readers[name], waiting, inlines[thread], pool)
    return _with_the_rest(order, ops)


def _argument_key(view, tensor):
    """Where TensorFlow lists the argument standing for `tensor` among a call's: after
    every node, in the order of the feed names, which DirectSession sorts before it
    builds a call's executors (for `Session.run` and partial runs alike).  A fed tensor
    is fed by its own name; a transfer by its ticket, named after the tensor within the
    plan's scope (run/compiling/plan_import.py)."""
    if tensor in view.feeds:
        return (tensor, tensor)
    return ("tfmem/plan/p_in/" + tensor.rsplit(":", 1)[0].replace("/", "_"), tensor)


def _node_ids(view, ops, originals, edges=None):
    """{op: its rank among the partition's node ids}.  TensorFlow numbers a graph's nodes
    as it builds them from a GraphDef, in topological order, the earliest listed ready
    node first; the user's ops (originals) are listed before tfmem's copies, the copies
    in the partition's order, and the arguments that stand for feeds and transfers come
    last, one after another (`_argument_key`), so ops that read none are numbered before
    any that does, and the readers of one argument before those of the next."""
    # originals first, each group in partition order (one int: heap entries compare fast)
    listed = {name: i + (len(ops) if name not in originals else 0) for i, name in enumerate(ops)}
    edges = edges or _Edges(view, ops)
    members = set(ops)
    readers, waiting = edges.readers, dict(edges.waiting)
    arguments = {}  # argument key -> the ops that read it
    first = []  # ops that wait on an outside control input only: with the first argument
    sources = view.sources
    for name in edges.reads_fed:  # the ops with a producer outside the partition, no state
        outside = {t for t, op in edges.inputs_of(view, name)
                   if op not in members and op not in sources}
        for tensor in outside:
            arguments.setdefault(_argument_key(view, tensor), []).append(name)
        if not outside:
            first.append(name)
        waiting[name] += len(outside) or 1
    pending = [arguments[key] for key in sorted(arguments)]
    if first:
        pending = [first + (pending[0] if pending else [])] + pending[1:]
    pending.reverse()  # popped from the end: the first argument first
    ready = [(listed[name], name) for name in ops if waiting[name] == 0]
    heapq.heapify(ready)
    ids = {}
    while ready or pending:
        if not ready:  # the next argument: after every node that could be numbered
            for name in pending.pop():
                waiting[name] -= 1
                if waiting[name] == 0:
                    heapq.heappush(ready, (listed[name], name))
            continue
        _, name = heapq.heappop(ready)
        ids[name] = len(ids)
        for reader in readers[name]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (listed[reader], reader))
    for name in ops:  # in a cycle
        ids.setdefault(name, len(ids))
    return ids


def _make_ready(inexpensive, names, waiting, inline, pool):
    """An op has run: its readers whose inputs are all there go to the inline queue (the
    `inexpensive` ones) or the pool, as `ScheduleReady` sends them."""
    kept = None  # the last expensive op made ready: this thread's next, maybe
    for reader in names:
        waiting[reader] -= 1
        if waiting[reader]:
            continue
        if reader in inexpensive:
            inline.append(reader)
            continue
        if kept is not None:
            pool.appendleft(kept)
        kept = reader
    if kept is not None:
        (pool.appendleft if inline else inline.append)(kept)


def dependency_order(view, ops, priority=None, edges=None):
    """The ops with producers first, keeping the partition's order where free (depth
    first, as the plan lists them), or picking among ready ops by `priority(name,
    position)` (the smallest first; called once per op, as it becomes ready).  `edges`:
    the `_Edges` of `ops`, when the caller has them."""
    position = {name: i for i, name in enumerate(ops)}
    waiting, readers = _edges(view, ops, edges=edges)
    if priority is None:
        entry, name_of = position.__getitem__, ops.__getitem__
    else:
        def entry(name):
            return priority(name, position[name]), position[name]

        def name_of(item):
            return ops[item[1]]
    # A heap of plan positions: linear-logarithmic, so a partition of a whole unrolled
    # graph (tens of thousands of ops) orders in milliseconds.
    ready = [entry(name) for name in ops if waiting[name] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        name = name_of(heapq.heappop(ready))
        order.append(name)
        for reader in readers[name]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, entry(reader))
    return _with_the_rest(order, ops)


def _with_the_rest(order, ops):
    ordered = set(order)
    return order + [name for name in ops if name not in ordered]
