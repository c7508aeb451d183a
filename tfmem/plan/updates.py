"""Updates: apply a step's state updates in one partition, the last one.

The depth-first order (see partition) applies each gradient as soon as it
is computed, so a training step's variable updates are spread over many
partitions, each its own Session call.  If a step fails between two of them
(a worker dies, a later partition runs out of memory) the variables hold a
half-applied update: some layers stepped, others not.  On a parameter
server that state is shared by every worker.

`gather` moves every update op, and everything that depends on one, into
one last partition, so a step either applies all its updates in one
Session call or none.  What moves is closed under "depends on", so the
order stays a valid topological order:

    before:  [fwd, grad3, apply3] [grad2, apply2] [grad1, apply1, step]
    after:   [fwd, grad3] [grad2] [grad1] [apply3, apply2, apply1, step]

The price: the gradients of all updates wait until the last partition
(device memory about the size of the trainable variables), and the last
partition may hold more than partition_size ops (the plan's partition_size
is then that partition's size).  tfmem does this by
default on a distributed session (variables on parameter servers), where
the updates are what other workers see; Options(atomic_updates=True) gives it
on a local session too.

Budget mode orders the other way round for another reason (`updates_last`): its
candidates slice the depth-first order with the updates, and what depends on
one, moved after everything else and a partition starting there, so that a
step that runs out of device memory before them has changed nothing and can
run again (`unchanged_before`).  There the updates keep partition_size.

An update is an op whose type writes a variable, accumulator, queue or
table (one table below).  Dequeues are not updates: an input pipeline's
dequeue feeds the whole step, which would then all be "after an update".
"""

from tfmem.plan.build import build_plan, validate
from tfmem.plan.partition import depth_first_order, slice_order
from tfmem.plan.units import units as units_of

UPDATE_TYPE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply",
                        "Assign", "Scatter", "ResourceScatter", "QueueEnqueue",
                        "LookupTableInsert", "LookupTableImport", "LookupTableRemove")
UPDATE_TYPES = frozenset({
    "AccumulatorApplyGradient", "ResourceAccumulatorApplyGradient",
    "SparseAccumulatorApplyGradient", "AccumulatorSetGlobalStep",
    "ResourceAccumulatorSetGlobalStep", "StridedSliceAssign", "ResourceStridedSliceAssign",
    "TensorScatterUpdate", "InitializeTable", "InitializeTableV2",
})


def is_update(op_type):
    """True for op types that write long-lived state another step (or worker) sees."""
    return op_type in UPDATE_TYPES or op_type.startswith(UPDATE_TYPE_PREFIXES)


def _consumers(view):
    readers = {}
    for node in view.nodes.values():
        for src in node.producers:
            readers.setdefault(src, set()).add(node.name)
    return readers


def after_updates(view):
    """Names of the view's update ops and of every op that depends on one."""
    readers = _consumers(view)
    stack = [name for name, node in view.nodes.items()
             if name not in view.sources and is_update(node.type)]
    seen = set(stack)
    while stack:
        for reader in readers.get(stack.pop(), ()):
            if reader in view.nodes and reader not in seen:
                seen.add(reader)
                stack.append(reader)
    return seen


def gather(plan, trace=None):
    """(plan, trace) with every update in the last partition; trace is None if it changed.

    The plan keeps its partition size, swap policy and placement.
    """
    view = plan.view
    late = after_updates(view)
    if not late or len(plan.partitions) < 2:
        return plan, trace
    groups = units_of(view)
    unit_of = {name: unit for unit in groups for name in unit}
    moving = {groups[i] for i in _late_units(view, groups, late)}
    last_ops = set(plan.partitions[-1].ops)
    if all(name in last_ops for unit in moving for name in unit):
        return plan, trace
    partitioned = [list(dict.fromkeys(unit_of[name] for name in p.ops)) for p in plan.partitions]
    ordered_moving = [unit for part in partitioned for unit in part if unit in moving]
    kept = [tuple(u for u in part if u not in moving) for part in partitioned]
    kept = [part for part in kept if part]
    # The update partition may hold more than partition_size ops: the plan says so.
    size = max(plan.partition_size, sum(len(unit) for unit in ordered_moving))
    gathered = build_plan(view, kept + [tuple(ordered_moving)], size, plan.policy,
                          plan.placement)
    validate(gathered)
    return gathered, None


def _late_units(view, groups, late=None):
    """Indices of the units (`groups`) that hold an update or depend on one (`late`: the
    ops `after_updates` names, if known).  A unit is never split: one op after an update
    moves its whole unit, and what depends on the unit's other ops with it."""
    late = after_updates(view) if late is None else late
    unit_of = {name: i for i, unit in enumerate(groups) for name in unit}
    moving = set()
    stack = [unit_of[name] for name in late if name in unit_of]
    readers = _consumers(view)
    while stack:
        index = stack.pop()
        if index in moving:
            continue
        moving.add(index)
        stack.extend(unit_of[r] for name in groups[index] for r in readers.get(name, ())
                     if r in unit_of and unit_of[r] not in moving)
    return moving


def updates_last(view, groups, order):
    """(order, cut): `order` (indices of `groups`, producers first) with every unit that
    updates state or depends on an update moved after all others, each part in its
    order; `cut`, the position of the first moved unit (None: nothing moves).

    Budget mode slices this order with a partition starting at `cut`: a step that runs
    out of device memory before it has changed no state, so it can be planned again and
    run again (`unchanged_before`), where the depth-first order would have applied a
    moving average in the forward pass or an update in the backward pass first.  The
    price is what the moved updates read, held until they run: small for a moving
    average, a gradient per variable for an optimizer that applies each as it comes."""
    moving = _late_units(view, groups)
    if not moving:
        return list(order), None
    early = [index for index in order if index not in moving]
    if len(early) == len(order):
        return list(order), None
    return early + [index for index in order if index in moving], len(early)


def partition_updates_last(view, groups, partition_size):
    """The view's units (`groups`) sliced as budget mode slices them at this size: in
    partitions of the `updates_last` order, one starting at its cut."""
    order, cut = updates_last(view, groups, depth_first_order(view, groups))
    return slice_order(groups, order, partition_size, cut)


def update_partitions(plan):
    """Indices of the plan's partitions that run an update op, in order."""
    return tuple(p.index for p in plan.partitions
                 if any(is_update(plan.view.nodes[name].type) for name in p.ops
                        if name in plan.view.nodes))


# Ops with side effects by their OpDef (stateful, or reading a resource or reference)
# that only read state: running them again changes nothing a later step sees.
STATE_READS = frozenset({
    "ReadVariableOp", "VarIsInitializedOp", "IsVariableInitialized", "VariableShape",
    "ResourceGather", "ResourceGatherNd", "Identity", "Snapshot", "Shape", "ShapeN",
    "Size", "Rank",
})


def changes_state(node):
    """Whether running the OpNode may change what a later step sees: a variable or table
    update, a draw from a random stream, a dequeue, a stateful call; any op with side
    effects but a read of state."""
    return node.side_effects and node.type not in STATE_READS


def unchanged_before(plan, index, failed_op=None):
    """Whether a step that failed in partition `index` has changed no state: no op that
    changes state in partitions 0..index may have run.  In the failed partition, an op
    depending on the op that failed (`failed_op`, when the error names it) cannot have
    run; any other may have.  Such a step can run again, as if it had never started."""
    view = plan.view
    nodes = view.nodes
    if any(changes_state(nodes[name]) for p in plan.partitions[:index]
           for name in p.ops if name in nodes):
        return False
    blocked = set()
    if failed_op in nodes:
        readers = _consumers(view)
        stack = [failed_op]
        while stack:
            for reader in readers.get(stack.pop(), ()):
                if reader not in blocked:
                    blocked.add(reader)
                    stack.append(reader)
    return not any(changes_state(nodes[name]) for name in plan.partitions[index].ops
                   if name in nodes and name not in blocked)
