"""Simulate: replay a plan's device and host memory without running TensorFlow.

The simulator walks the same plan the executor runs, with the same transfer
schedule, and keeps byte counts instead of tensors:

    device = state (variables, constants)
           + device copies of transfers alive across the partition
           + the partition's working set (its tensors from first write to
             last read; kept and swapped outputs until the run ends)
    host   = host buffers of swapped transfers

Inside a partition, ops run in the worst of the orders TensorFlow's executor
may take (`op_order.py`); an op's output is freed after its last reader.  Ops
that return a view of their input (Identity, Reshape, a variable read, a sum
that reduces nothing) allocate nothing, and elementwise ops write into an
input that dies with them, as TensorFlow's kernels forward buffers.  Shape,
Size and Rank read no data: TensorFlow runs them as soon as their input
exists, so they do not keep it alive.  Byte sizes come from static shapes, or
from `shapes.resolve_shapes` when feeds fix unknown dimensions; a tensor of
unknown size counts as 0 and is reported in `unknown_tensors`.  Equal ops of
a partition are merged, as TensorFlow merges them (`dedup.py`), and a
kernel's extra outputs (oneDNN max pooling's workspace) live until the reader
that uses them (`workspace.py`).

Every allocation and free is also logged in order and replayed through
TensorFlow's BFC allocator policy (`allocator.py`): `device_peak_chunks` is the
peak in the chunks that allocator reports, which can exceed the bytes requested
(a chunk less than twice a request is handed out whole).
"""

import dataclasses
import functools

from tfmem.memory import dedup, op_order
from tfmem.memory.allocator import AllocationLog, Regions, replay
from tfmem.memory.concurrency import overlapping_buffers
from tfmem.memory.workspace import Workspaces
from tfmem.plan import optypes
from tfmem.plan.analyse import split_tensor_name, tensor_bytes
from tfmem.plan.optypes import SHAPE_ONLY, reads_state, updates_variable
from tfmem.plan.schedule import Schedule

# Ops whose output is (a view of) an input or of state counted elsewhere.
ALIASING = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "EnsureShape", "CheckNumerics", "ReadVariableOp", "GetSessionTensor",
    "Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge", "RefMerge",
    "NextIteration", "Const",
})
# Elementwise ops whose kernels write into a same-sized input when it dies with them.
FORWARDING = frozenset({
    "Abs", "Add", "AddN", "AddV2", "BiasAdd", "Cos", "Elu", "EluGrad", "Exp", "Log",
    "Maximum", "Minimum", "Mul", "Neg", "Pow", "RealDiv", "Relu", "Relu6", "ReluGrad",
    "Relu6Grad", "Rsqrt", "Sigmoid", "SigmoidGrad", "Sin", "Sqrt", "Square",
    "SquaredDifference", "Sub", "Tanh", "TanhGrad", "Sign", "Floor", "Reciprocal",
})


@dataclasses.dataclass(frozen=True)
class PartitionMemory:
    """Bytes around one partition's run."""
    index: int
    device_before: int  # resident when the run starts
    device_peak: int  # predicted high-water mark during the run
    device_after: int  # resident after the run (state and transfers kept)
    host_after: int  # host buffers held after the run
    to_host: int  # bytes swapped out after the run
    to_device: int  # bytes the prefetcher uploads while it runs
    scratch: int = 0  # the largest kernel scratch of one of its ops (counted in the peak)
    # The peak in the allocator's chunks (allocator.replay): what TensorFlow's BFC
    # allocator reports in use, a chunk often larger than its request.
    device_peak_chunks: int = 0
    # The peak in bytes requested (device_peak, unless `chunks` raised it).
    device_peak_requested: int = 0
    # Whether the replayed allocator served every request of the partition within the
    # device's limit (Regions.limit); always True without a limit.
    served: bool = True


@dataclasses.dataclass(frozen=True)
class MemoryTrace:
    """The predicted memory of one step of a plan."""
    partitions: tuple
    state_bytes: int
    unknown_tensors: int
    regions: Regions = Regions()  # the allocator layout the chunk replay started from

    @property
    def peak_device(self):
        return max((p.device_peak for p in self.partitions), default=self.state_bytes)

    @property
    def peak_device_requested(self):
        """The predicted peak in bytes requested, whatever `chunks` made `peak_device`."""
        return max((p.device_peak_requested for p in self.partitions),
                   default=self.state_bytes)

    @property
    def served(self):
        """Whether the replayed allocator served every request within the device's limit."""
        return all(p.served for p in self.partitions)

    @property
    def peak_device_chunks(self):
        """The predicted peak in BFC allocator chunks (TensorFlow's in-use figure)."""
        return max((p.device_peak_chunks for p in self.partitions), default=self.state_bytes)

    @property
    def peak_partition(self):
        return max(self.partitions, key=lambda p: p.device_peak).index if self.partitions else None

    @property
    def peak_host(self):
        return max((p.host_after for p in self.partitions), default=0)

    @property
    def bytes_to_host(self):
        return sum(p.to_host for p in self.partitions)

    @property
    def bytes_to_device(self):
        return sum(p.to_device for p in self.partitions)

    def __str__(self):
        mib = float(1 << 20)
        lines = [f"predicted device peak {self.peak_device / mib:.1f} MiB in partition "
                 f"{self.peak_partition} (state {self.state_bytes / mib:.1f} MiB), host peak "
                 f"{self.peak_host / mib:.1f} MiB, {self.bytes_to_host / mib:.1f} MiB out, "
                 f"{self.bytes_to_device / mib:.1f} MiB in"
                 + (f"; {self.unknown_tensors} tensors of unknown size" if self.unknown_tensors
                    else "")]
        lines.append(f"{'part':>5} {'before':>9} {'peak':>9} {'after':>9} {'host':>9} "
                     f"{'out':>8} {'in':>8}  (MiB)")
        for p in self.partitions:
            lines.append(f"{p.index:>5} {p.device_before / mib:>9.1f} {p.device_peak / mib:>9.1f} "
                         f"{p.device_after / mib:>9.1f} {p.host_after / mib:>9.1f} "
                         f"{p.to_host / mib:>8.1f} {p.to_device / mib:>8.1f}")
        return "\n".join(lines)


class TensorSizes:
    """Byte size of each tensor, from resolved or static shapes."""

    def __init__(self, view, shapes):
        self._view = view
        self._shapes = shapes or {}
        self.unknown = set()
        self._known = {}  # tensor -> bytes: every candidate plan asks for the same tensors

    def __call__(self, tensor):
        nbytes = self._known.get(tensor)
        if nbytes is None:
            nbytes = self._known[tensor] = self._measure(tensor)
        return nbytes

    def _measure(self, tensor):
        info = self._view.tensor(tensor)
        if not optypes.has_fixed_size(info.dtype):
            return 0
        nbytes = tensor_bytes(info.dtype, self._shapes.get(tensor, info.shape))
        if nbytes is None:  # a dimension still unknown
            bound = self._bound(tensor)
            if bound is None:
                self.unknown.add(tensor)
            return bound or 0
        return nbytes


    def _bound(self, tensor):
        """Bytes at most, for outputs whose length only their values decide."""
        op_name, _ = split_tensor_name(tensor)
        node = self._view.nodes.get(op_name)
        if node is not None and node.type == "BroadcastGradientArgs":
            # Axes to reduce: at most one per dimension of the longer input shape.
            lengths = [self(t) for t in node.inputs]
            return max(lengths) if all(lengths) else None
        return None


# The orders the simulator tries for a partition's ops.
partition_orders = op_order.partition_orders


# Aliasing ops whose outputs are views of a data input's buffer (output i of
# IdentityN views input i; every other op's outputs view input 0): the buffer
# lives until the view's last reader too.  Const, variable reads and session
# tensors view state or a handle counted elsewhere; Merge and NextIteration pass
# one of several inputs, decided at run time.
VIEWS = ALIASING - frozenset({"Const", "ReadVariableOp", "GetSessionTensor", "Merge",
                              "RefMerge", "NextIteration"})
# Reductions whose kernel returns its input when it reduces nothing (every reduced
# dimension of size one): a broadcasting op's gradient sums over the axes
# BroadcastGradientArgs returns, most often none.
REDUCTIONS = frozenset({"Sum", "Mean", "Prod", "Max", "Min", "All", "Any"})


def _is_view(view, name, size):
    node = view.nodes[name]
    if node.type in VIEWS:
        return bool(node.inputs)
    if node.type in REDUCTIONS:
        source = split_tensor_name(node.inputs[0])[0]
        if source not in view.nodes and source not in view.sources:  # fed: not ours
            return False
        nbytes = size(f"{name}:0")
        return bool(nbytes) and nbytes == size(node.inputs[0])
    return False


class _ViewTest:
    """`_is_view` of each op, found once: every order of every partition a search
    simulates asks it again.  `links(name)`: the (output, viewed input) pairs of a view
    op, () for any other op."""

    def __init__(self, view, size):
        self._view, self._size, self._known = view, size, {}
        self._links = {}

    def __call__(self, name):
        known = self._known.get(name)
        if known is None:
            known = self._known[name] = _is_view(self._view, name, self._size)
        return known

    def links(self, name):
        pairs = self._links.get(name)
        if pairs is None:
            pairs = ()
            if self(name):
                node = self._view.nodes[name]
                pairs = tuple((tensor, node.inputs[index if node.type == "IdentityN" else 0])
                              for index, tensor in enumerate(node.output_names))
            self._links[name] = pairs
        return pairs


def _buffers(view, order, size, merged=None, is_view=None):
    """{tensor: the tensor whose buffer it is}, through chains of views, and through the
    equal ops Grappler merges (`merged`: {op: the op kept in its place}, see dedup).
    `is_view`: a `_ViewTest` of `view` and `size`, when the caller has one."""
    is_view = is_view or _ViewTest(view, size)
    known, links = is_view._links, is_view.links  # per op of every order: a dict look-up
    root = {}
    for name in order:
        if merged and name in merged:
            for tensor, kept in zip(view.nodes[name].output_names,
                                    view.nodes[merged[name]].output_names):
                root[tensor] = root.get(kept, kept)
            continue
        pairs = known.get(name)
        if pairs is None:
            pairs = links(name)
        for tensor, source in pairs:
            root[tensor] = root.get(source, source)
    return root


class _RecordedEvents:
    """The allocations and frees one partition's working set made, to make again on the log
    of another candidate plan with the same partition (`simulate`'s `working_sets`)."""

    def __init__(self):
        self.calls = []

    def produce(self, *args):
        self.calls.append(("produce", args))

    def allocate(self, *args):
        self.calls.append(("allocate", args))

    def scratch(self, *args):
        self.calls.append(("scratch", args))

    def release(self, *args):
        self.calls.append(("release", args))

    def rename(self, *args):
        self.calls.append(("rename", args))

    def replay(self, log):
        if isinstance(log, _RecordedEvents):  # recorded again: the same calls
            log.calls.extend(self.calls)
            return
        bound = {name: getattr(log, name)
                 for name in ("produce", "allocate", "scratch", "release", "rename")}
        for method, args in self.calls:
            bound[method](*args)


class _Hopeless(Exception):
    """A partition's working set (at least `working_set` bytes) already puts the candidate
    plan over its budget."""

    def __init__(self, working_set):
        super().__init__(working_set)
        self.working_set = working_set


def _working_set_of(view, partition, size, keep_until_end, freed_inside, scratch, events,
                    working_sets, hopeless=None, **options):
    """`_working_set`, taken from `working_sets` (a dict, or None) where a candidate plan
    before had this partition with the same tensors kept and freed in it."""
    if working_sets is None:
        return _working_set(view, partition, size, keep_until_end, freed_inside, scratch,
                            events, hopeless, **options)
    key = (partition.ops, frozenset(keep_until_end), frozenset(freed_inside.items()),
           options.get("forwardable"), frozenset((options.get("copy_on_write") or {}).items()))
    known = working_sets.get(key)  # (peak, recorded), or (a lower bound, None)
    if known is None or known[1] is None:
        if known is not None and hopeless is not None and hopeless(known[0]):
            raise _Hopeless(known[0])
        recorded = _RecordedEvents()
        try:
            known = working_sets[key] = (
                _working_set(view, partition, size, keep_until_end, dict(freed_inside),
                             scratch, recorded, hopeless, **options), recorded)
        except _Hopeless as over:
            working_sets[key] = (over.working_set, None)
            raise
    peak, recorded = known
    if hopeless is not None and hopeless(peak):
        raise _Hopeless(peak)
    if events is not None:
        recorded.replay(events)
    return peak


def _working_set(view, partition, size, keep_until_end, freed_inside, scratch, events=None,
                 hopeless=None, **options):
    """Peak bytes the partition allocates beyond what is resident when it starts, in the
    worst of the orders TensorFlow's executor may take (`partition_orders`); `events`
    record that order.  See `_in_order` for the other arguments.

    `hopeless`: a test of a working set; once one order's passes it, `_Hopeless` is
    raised and the other orders are neither made nor walked (the worst can only be
    larger).

    Chained copies (op_order.chained_order) run one kernel at a time, and are not
    merged: equal ops waiting for different ops before them are not equal to Grappler.
    Their last reader of a `forwardable` input runs after its deleter
    (rewrite.freed_last_readers), so it may write its output into that input."""
    if op_order.is_chained(view, partition.ops):
        options = dict(options, signatures=None, concurrent_ops=1)
    else:
        options = dict(options, forwardable=frozenset())
    facts = options["facts"] = options.get("facts") or \
        _ViewFacts(view, size, options.get("signatures"))
    walked, worst, equal = [], None, None
    for order in partition_orders(view, partition.ops, view.originals,
                                  threads=options.get("concurrent_ops", 1)):
        if order in walked:
            continue
        walked.append(order)
        if equal is None:  # the equal ops, found in the first order for every order
            equal = dedup.Duplicates(view, order, options.get("signatures"), keep_until_end,
                                     facts.equality)
            merged = equal.first
        else:
            merged = equal.in_order(order)
        recorded = _RecordedEvents() if events is not None else None
        peak = _in_order(view, order, size, keep_until_end, dict(freed_inside), scratch,
                         recorded, merged=merged, **options)
        if worst is None or peak > worst[0]:  # the first of the worst
            worst = (peak, recorded)
        if hopeless is not None and hopeless(peak):
            raise _Hopeless(peak)
    peak, recorded = worst
    if recorded is not None:
        recorded.replay(events)
    return peak


def _in_order(view, order, size, keep_until_end, freed_inside, scratch, events=None,
              workspaces=Workspaces(), signatures=None, concurrent_ops=1,
              forwardable=frozenset(), early_scratch=None, copy_on_write=None, facts=None,
              merged=None):
    """Peak bytes the partition allocates beyond what is resident when it starts.

    `freed_inside` maps resident inputs whose in-graph deleter runs in this partition
    to their bytes: they are released after their last reader, not at the end.  Those
    in `forwardable` have their deleter run before their last reader, which may write
    its output into them like into a dying buffer of its own partition, when no later
    op holds the buffer (a Shape op reads none of its bytes, but holds it).
    `scratch` maps op names to the bytes their kernel allocates besides its outputs,
    held while it runs, with its inputs and outputs alive.  `events` (an
    `AllocationLog`), when given, records every allocation and free in order, for
    the allocator replay.

    Buffers, not tensors, are alive: a view (Identity, Reshape, a gradient's
    control-dependency Identity) keeps the buffer it views until its own last
    reader, as TensorFlow's reference-counted buffers do.  An op equal to an earlier
    one of the partition (`signatures`, see dedup) is merged into it, as Grappler
    does: it allocates nothing and its readers keep the earlier op's buffers.
    A kernel's extra outputs (`workspaces`, see workspace) live from its op to the
    last reader paired with it in the partition, whose scratch is then the paired one.
    With `concurrent_ops` above one, an op's scratch is held beside that of the ops
    that may run at the same time (see concurrency).  The part of an op's scratch its
    kernel allocates before its outputs (`early_scratch`, see
    scratch.scratch_before_outputs) is logged before them, the rest after.
    `copy_on_write` ({update op: (bytes, the resident variable reads it finds alive)},
    see `_copies_on_write`): such an op, run while one of those reads is alive, gives its
    variable a new buffer, held to the partition's end.  `facts`: the `_ViewFacts` of
    the view at these sizes and signatures, when the caller has them.  `merged`: the
    equal ops of `order` (`dedup.duplicates`), when the caller has them.
    """
    facts = facts or _ViewFacts(view, size, signatures)
    copy_on_write = copy_on_write or {}
    freed_later = frozenset(freed_inside)  # resident inputs this partition may free
    if merged is None:
        merged = dedup.duplicates(view, order, signatures, keep_until_end, facts.equality)
    root = _buffers(view, order, size, merged, facts.is_view)
    scratch = _scratch_in_partition(scratch, workspaces, order, merged)
    beside = overlapping_buffers(view, order, scratch, concurrent_ops)
    overlap = {name: sum(sizes) for name, sizes in beside.items()}
    workspace_end = _workspace_ends(view, order, workspaces, merged)
    workspaces_dying = {}  # step -> the forward ops whose extra outputs are freed after it
    for op, end in workspace_end.items():
        workspaces_dying.setdefault(end, []).append(op)
    nodes = view.nodes
    last_read, last_held, reads = {}, {}, []  # reads: the buffers each step reads
    for step, name in enumerate(order):
        node = nodes[name]
        inputs = node.inputs
        if len(inputs) == 1:
            read = [root.get(inputs[0], inputs[0])]
        elif root:
            read = list(dict.fromkeys([root.get(t, t) for t in inputs]))
        else:
            read = list(dict.fromkeys(inputs))
        reads.append(read)
        if node.type in SHAPE_ONLY:
            for buffer in read:
                last_held[buffer] = step
        else:
            for buffer in read:
                last_held[buffer] = step
                last_read[buffer] = step
    # A kept view keeps its buffer; the simulate loop finds it under the view's name.
    kept = {root.get(t, t) for t in keep_until_end}
    handed_on = {root[t]: t for t in keep_until_end if t in root and root[t] not in keep_until_end}
    live, current, peak = {}, 0, 0
    scratch_of, overlap_of = scratch.get, overlap.get  # the loop below runs per op and order
    for step, name in enumerate(order):
        node, read = nodes[name], reads[step]
        dying = [b for b in read if b in live and last_read.get(b) == step and b not in kept]
        early = min(early_scratch.get(name, 0), scratch_of(name, 0)) if early_scratch else 0
        if events is not None and early:
            events.allocate((name, "early scratch"), early)
        aliasing, forwarding = node.type in ALIASING, node.type in FORWARDING
        for tensor in node.output_names:
            if tensor in root:  # a view: no allocation of its own
                continue
            nbytes = 0 if aliasing else size(tensor)
            reuse = None
            if nbytes and forwarding:
                for buffer in dying:  # the first dying input of its size
                    if live[buffer] == nbytes:
                        reuse = buffer
                        break
                if reuse is not None:
                    dying.remove(reuse)
                    current -= live.pop(reuse)
                elif forwardable:
                    for buffer in read:
                        if (buffer in forwardable and freed_inside.get(buffer) == nbytes
                                and last_held.get(buffer) == step):
                            reuse = buffer
                            break
                    if reuse is not None:
                        current -= freed_inside.pop(reuse)
            live[tensor] = nbytes
            current += nbytes
            if events is not None:
                events.produce(tensor, nbytes, reuse)
        if name in workspace_end:  # its kernel's extra outputs (a workspace)
            live[(name, "workspace")] = workspaces.extra[name]
            current += workspaces.extra[name]
            if events is not None:
                events.allocate((name, "workspace"), workspaces.extra[name])
        copy = copy_on_write.get(name)
        if copy is not None and any(t not in freed_later or t in freed_inside for t in copy[1]):
            live[(name, "copy on write")] = copy[0]
            current += copy[0]
            if events is not None:
                events.allocate((name, "copy on write"), copy[0])
        kernel = scratch_of(name, 0)
        if events is not None and kernel:
            events.scratch(kernel - early, *beside.get(name, ()))
            events.release((name, "early scratch"))
        running = current + kernel + overlap_of(name, 0)
        if running > peak:
            peak = running
        ending = workspaces_dying.get(step)
        if ending:
            dying += [(op, "workspace") for op in ending]
        for buffer in dying:
            current -= live.pop(buffer)
            if events is not None:
                events.release(buffer)
        if freed_inside:
            for buffer in read:
                if buffer in freed_inside and last_read.get(buffer) == step:
                    current -= freed_inside.pop(buffer)
                    if events is not None:
                        events.release(buffer)
        for tensor in node.output_names:
            if tensor in live and tensor not in last_read and tensor not in kept:
                current -= live.pop(tensor)
                if events is not None:
                    events.release(tensor)
    if events is not None:
        for buffer, tensor in handed_on.items():
            events.rename(buffer, tensor)
    return peak


def _scratch_in_partition(scratch, workspaces, order, merged):
    """The partition's scratch per op: none for merged ops, the paired figure for a reader
    whose forward op (see workspace) runs in the partition too."""
    present = set(order).difference(merged) if workspaces.paired else ()
    adjusted = {}
    for name in order:
        if name in merged:
            continue
        pairing = workspaces.paired.get(name)
        if pairing is not None and pairing[0] in present:
            adjusted[name] = pairing[1]
        elif scratch.get(name):
            adjusted[name] = scratch[name]
    return adjusted


def _workspace_ends(view, order, workspaces, merged):
    """{forward op: the step its extra outputs are freed after}: its last paired reader's,
    or its own when no paired reader runs in the partition."""
    if not workspaces.extra:
        return {}
    step_of = {name: step for step, name in enumerate(order) if name not in merged}
    ends = {name: step for name, step in step_of.items() if name in workspaces.extra}
    for reader, step in step_of.items():
        pairing = workspaces.paired.get(reader)
        if pairing is not None and pairing[0] in ends and step > step_of[pairing[0]]:
            ends[pairing[0]] = max(ends[pairing[0]], step)
    return ends


def _buffer_holders(view, plan, partition, size, facts=None):
    """{kept output: the kept output of the same buffer read last}, for kept outputs of
    `partition` that are views of one buffer (an Add's gradient: the Identity and the
    Reshape of its unreduced sums view the incoming gradient): the buffer is held once,
    until the last of them is read, not once per tensor.  `facts`: the view's
    `_ViewFacts`, when the caller has them."""
    root = facts.buffers(partition.ops) if facts is not None else \
        _buffers(view, partition.ops, size)
    kept = {}
    for tensor in partition.outputs:
        if plan.transfer(tensor).kept:
            kept.setdefault(root.get(tensor, tensor), []).append(tensor)
    holders = {}
    for tensors in kept.values():
        if len(tensors) > 1:
            last = max(tensors, key=lambda t: plan.transfer(t).spans[-1].readers[-1])
            holders.update((t, last) for t in tensors)
    return holders


def _copies_on_write(view, plan, partition, size, updates=None):
    """{op of `partition` that updates a variable: (the variable's bytes, the reads of it
    kept on the device for this partition)}.  A kept read is a view of the variable's
    buffer, held by tfmem (a session handle, an eager tensor) until its last reader here
    is done: TensorFlow's update kernels then copy the variable to a new buffer before
    writing it, and the old one lives on with the read (copy-on-write).  In a whole step
    the reads are usually gone before the updates run, and nothing is copied."""
    reads = {}
    for tensor in partition.inputs:
        producer = view.nodes.get(split_tensor_name(tensor)[0])
        if (producer is not None and producer.inputs and plan.transfer(tensor).kept
                and reads_state(producer, view.sources)):
            reads.setdefault(producer.inputs[0], []).append(tensor)
    if not reads:
        return {}
    updates = updates if updates is not None else _variable_updates(view)
    copies = {}
    for name in partition.ops:
        if name not in updates:
            continue
        node = view.nodes[name]
        if node.inputs[0] in reads:
            held = tuple(reads[node.inputs[0]])
            copies[name] = (max(size(t) for t in held), held)
    return copies


def _variable_updates(view):
    """The view's ops that write a resource variable (`optypes.updates_variable`)."""
    return frozenset(name for name, node in view.nodes.items() if updates_variable(node))


class _ViewFacts:
    """What the simulator asks of a view's ops, at one set of tensor sizes and dedup
    signatures, for every order of every partition: whether an op's outputs view an
    input, what makes it equal to another (`dedup.EqualityFacts`), which ops update a
    variable, the bytes of the state it reads, and each partition's views (`buffers`)."""

    def __init__(self, view, size, signatures):
        self.signatures = signatures
        self.is_view = _ViewTest(view, size)
        self.equality = dedup.EqualityFacts(view, signatures or {})
        self._view, self._size = view, size
        self._buffers = {}

    def buffers(self, ops):
        """`_buffers` of a partition's `ops` (no op merged), found once per partition: a
        search predicts one partition under several swap distances."""
        root = self._buffers.get(ops)
        if root is None:
            root = self._buffers[ops] = _buffers(self._view, ops, self._size,
                                                 is_view=self.is_view)
        return root

    @functools.cached_property
    def variable_updates(self):
        return _variable_updates(self._view)

    @functools.cached_property
    def state_bytes(self):
        return state_bytes(self._view, self._size)


@dataclasses.dataclass
class CandidateShare:
    """What the simulations of one search's candidate plans (one view, shapes and options)
    share: the tensors' sizes, the working set of every partition met before (see
    `_working_set_of`), and the facts of its ops (`facts_for`)."""
    sizes: TensorSizes
    working_sets: dict = dataclasses.field(default_factory=dict)
    facts: object = None  # a _ViewFacts

    def facts_for(self, view, signatures):
        """The `_ViewFacts` of `view` at these sizes and `signatures` (made again for other
        signatures: the share serves one search, whose signatures are one dict)."""
        if self.facts is None or self.facts.signatures is not signatures:
            self.facts = _ViewFacts(view, self.sizes, signatures)
        return self.facts


def state_bytes(view, size):
    """Bytes of the variables and constants the request reads: resident for the whole step."""
    return sum(node.state_bytes for node in view.sources.values()) + sum(
        size(f"{name}:0") for name, node in view.sources.items() if node.type == "Const")


def simulate(plan, shapes=None, early_frees=True, scratch=None, slack=0, chunks=False,
             workspaces=None, signatures=None, concurrent_ops=1, regions=Regions(),
             share=None, early_scratch=None, give_up=None, reject=None):
    """The MemoryTrace of one step of `plan`; `shapes` from `shapes.resolve_shapes`,
    `scratch` ({op name: bytes}) from `scratch.calibrate`; `slack` bytes are added to
    every partition's peak (budget mode's allowance for the allocator's chunks).
    `workspaces` (workspace.Workspaces), `signatures` (dedup.signatures),
    `concurrent_ops` (how many kernels may run at once, see concurrency), `regions`
    (the allocator layout the chunk replay starts from) and `early_scratch` ({op name:
    bytes of its scratch allocated before its outputs}) come with the scratch in a
    `Sizing` (`**sizing.simulate_options()`).

    With `early_frees`, a device copy whose deleter runs in a partition is freed
    after its last reader there (what usually happens); without, at the
    partition's end, the bound budget mode plans with (TensorFlow's executor may
    run the deleter late, and the prediction misses other memory: see budget).

    Each partition's `device_peak_chunks` replays the step's allocations through
    TensorFlow's BFC policy (`allocator.replay`), `slack` added as well.  With
    `chunks`, each `device_peak` is the larger of the two figures (budget mode's
    bound: the replayed order is one the executor may take, not the only one).

    `share`: a `CandidateShare` of the search this plan is a candidate of, whose sizes are
    used and where a partition met again is not simulated again.

    `give_up`: a test of each partition's `PartitionMemory` (its peak in bytes requested);
    the first partition it holds for ends the simulation, which then returns None.  A
    search rejects a candidate at the first partition found over the budget and spends
    nothing on the others; with a `share`, partitions are tried from the one that starts
    with the most resident down, where a step's peak usually is.  `reject`: a test of a
    MemoryTrace that more of the allocator replay could only make fail again (its peaks
    only rise, its partitions only lose being served); a trace it holds for as soon as
    part of the replay is done ends the simulation, which returns None.
    """
    view = plan.view
    size = share.sizes if share is not None else TensorSizes(view, shapes)
    facts = share.facts_for(view, signatures) if share is not None else \
        _ViewFacts(view, size, signatures)
    memo = share.working_sets if share is not None else None
    options = dict(workspaces=workspaces or Workspaces(), signatures=signatures,
                   concurrent_ops=concurrent_ops, early_scratch=early_scratch, facts=facts)

    def working_set(start, events):
        """The working set of one partition (see `_walk`), recorded in `events`."""
        index, partition, before, keep_until_end, freed_inside, forwardable, copies = start
        hopeless = None
        if give_up is not None:
            def hopeless(working_set):
                return give_up(PartitionMemory(index, before, before + working_set + slack,
                                               0, 0, 0, 0))
        return _working_set_of(view, partition, size, keep_until_end, freed_inside,
                               scratch or {}, events, memo, hopeless, forwardable=forwardable,
                               copy_on_write=copies, **options)

    found = {}
    try:
        if give_up is not None and memo is not None:
            # A candidate over the budget is rejected at the partition that goes over,
            # most often the one that starts with the most resident: the working sets are
            # found in that order (each partition's start does not depend on the working
            # sets before it), and the walk in plan order below takes them from `memo`.
            starts = []
            _walk(plan, size, facts, early_frees, scratch, slack, None,
                  lambda start, log: starts.append(start) or 0, found)
            for start in sorted(starts, key=lambda start: (-start[2], start[0])):
                working_set(start, None)
        return _walk(plan, size, facts, early_frees, scratch, slack, give_up, working_set,
                     found, chunks, regions, reject)
    except _Hopeless:
        return None


def _walk(plan, size, facts, early_frees, scratch, slack, give_up, working_set, found,
          chunks=False, regions=None, reject=None):
    """`simulate`'s walk of the plan's partitions in order, the working set of each from
    `working_set((index, partition, resident bytes at its start, tensors kept to its end,
    resident inputs freed inside, those forwardable, copies on write), log)`; the
    MemoryTrace, or None when `give_up` holds for a partition.  With `regions` None, only
    the walk: no allocator replay, no trace.  `found`: {partition index: its copies on
    write and buffer holders}, filled by the first walk of the plan for the next."""
    view = plan.view
    schedule = Schedule(plan)
    state = facts.state_bytes
    log = AllocationLog()
    for name, node in view.sources.items():
        log.allocate_state(name, node.state_bytes + (size(f"{name}:0") if node.type == "Const"
                                                     else 0))
    live, host, uploads_left = {}, {}, dict(schedule.upload_count)
    live_bytes = 0  # sum(live.values()), kept as live changes
    shared = set()  # kept tensors whose buffer another kept tensor views (_buffer_holders)
    trace = []
    for index, partition in enumerate(plan.partitions):
        log.partition(index)
        to_device = 0
        for tensor, reader in schedule.uploads[index]:
            live_bytes += size(tensor) - live.get((tensor, reader), 0)
            live[(tensor, reader)] = size(tensor)
            log.upload((tensor, reader), size(tensor), reader)
            to_device += size(tensor)
        before = state + live_bytes
        # in the plan's order: which of two kept views of one buffer it is handed on to
        # (`_in_order`) must not follow a set's order, which changes with the string hash
        keep_until_end = dict.fromkeys(partition.outputs + partition.fetches)
        freed_inside = {key[0]: live[key] for key in schedule.frees[index]
                        if key in live and early_frees}
        # a buffer another kept view holds too is not the reader's alone
        forwardable = frozenset(t for t in freed_inside if t not in shared)
        if index not in found:
            found[index] = (_copies_on_write(view, plan, partition, size,
                                             facts.variable_updates),
                            _buffer_holders(view, plan, partition, size, facts))
        copies, holders = found[index]
        for key in schedule.frees[index]:
            if key in live and early_frees:
                log.rename(key, key[0])
        working_set_bytes = working_set((index, partition, before, keep_until_end, freed_inside,
                                         forwardable, copies), log)
        peak = before + working_set_bytes
        for op in copies:  # the variable's new buffer is its state from now on
            log.release((op, "copy on write"))
        for key in schedule.frees[index]:
            live_bytes -= live.pop(key, 0)
            log.release(key)
            log.release(key[0])
        for tensor, reader in [k for k in schedule.uploads[index]]:
            uploads_left[tensor] -= 1
            if uploads_left[tensor] == 0:
                host.pop(tensor, None)
        to_host = 0
        shared.update(holders)
        for tensor, holder in holders.items():  # one buffer: the log holds it for `holder`
            if tensor != holder:
                log.rename(tensor, holder)
        for tensor in partition.outputs:
            transfer = plan.transfer(tensor)
            if transfer.kept:  # a variable read is a view of state counted already
                producer = view.nodes[split_tensor_name(tensor)[0]]
                key = schedule.kept[tensor]
                kept = (0 if reads_state(producer, view.sources)
                        or holders.get(tensor, tensor) != tensor else size(tensor))
                live_bytes += kept - live.get(key, 0)
                live[key] = kept
                if not log.holds(tensor):  # an aliasing op's: the buffer it views
                    log.allocate(tensor, kept)
                log.rename(tensor, schedule.kept[tensor])
            if transfer.swapped:
                host[tensor] = size(tensor)
                to_host += size(tensor)
        for tensor in keep_until_end:
            log.release(tensor)
        after = state + live_bytes
        # An aliasing op's kept output holds a buffer the working set saw die.
        peak = max(peak, after) + slack
        kernel = max((scratch.get(name, 0) for name in partition.ops), default=0) \
            if scratch else 0
        trace.append(PartitionMemory(index, before, peak, after,
                                     sum(host.values()), to_host, to_device, kernel))
        if give_up is not None and give_up(trace[-1]):
            return None
    if regions is None:
        return None

    def traced(replayed, served):
        chunked = []
        for p in trace:  # PartitionMemory(...) by field: replace() costs 4x as much
            in_chunks = replayed.get(p.index, 0) + slack
            chunked.append(PartitionMemory(
                p.index, p.device_before,
                max(p.device_peak, in_chunks) if chunks else p.device_peak,
                p.device_after, p.host_after, p.to_host, p.to_device, p.scratch,
                device_peak_chunks=in_chunks, device_peak_requested=p.device_peak,
                served=served.get(p.index, True)))
        return MemoryTrace(tuple(chunked), state, len(size.unknown), regions)

    stop = None if reject is None else lambda replayed, served: reject(traced(replayed, served))
    replayed, served = replay(log, regions=regions, stop=stop)
    return None if replayed is None else traced(replayed, served)
