"""Partition: a depth-first order of the units, sliced into partitions.

The order is a post-order depth-first walk from the fetches and targets:
each unit is emitted right after the units it consumes, so a value is
consumed soon after it is produced and few values are alive at once:

    loss <- dense2 <- relu1 <- dense1 <- x        order: dense1 relu1 dense2 loss

Among a unit's inputs, the shallowest (fewest units on its longest path from
the sources) is walked first: what is nearly computed is finished and
consumed before a long chain starts.  For a training step this applies each
layer's gradient as soon as the backward pass has produced it, instead of
holding every gradient until the first layer's is done:

    train <- apply_0 <- grad_w0 <- ... <- grad_w23 <- loss
          <- apply_23 <- grad_w23            walked first: it is shallower

Shape, Size and Rank read only their input's shape (a gradient's broadcast
arithmetic asks for the shape of every forward operand).  Each is emitted
right after the unit that produces its input, so the operand is not kept
alive, or sent across a boundary, just to be measured.

The order is then cut greedily into partitions of at most `partition_size`
ops.  A unit is never cut, so a unit larger than `partition_size` gets a
partition of its own.  Everything here is a pure function of the view:
the same graph and request always give the same partitions.
"""

import numbers

from tfmem.plan.analyse import split_tensor_name
from tfmem.plan.optypes import SHAPE_ONLY
from tfmem.plan.units import unit_graph


def _depths(inputs):
    """Longest path, in units, from a unit without inputs to each unit (the units form a
    DAG: a unit's inputs are finished before it is)."""
    depth = [0] * len(inputs)
    reached = [False] * len(inputs)
    for root in range(len(inputs)):
        if reached[root]:
            continue
        reached[root] = True
        stack = [(root, iter(inputs[root]))]
        while stack:
            unit, pending = stack[-1]
            for src in pending:
                if not reached[src]:
                    reached[src] = True
                    stack.append((src, iter(inputs[src])))
                    break
            else:
                stack.pop()
                deepest = 0
                for src in inputs[unit]:
                    if depth[src] > deepest:
                        deepest = depth[src]
                depth[unit] = deepest + 1
    return depth


def depth_first_order(view, groups):
    """Indices of `groups` (the units) in post-order from the request's fetches and targets."""
    unit_of, inputs = unit_graph(view, groups)
    depth = _depths(inputs)
    by_depth = depth.__getitem__
    inputs = [sorted(srcs, key=by_depth) if len(srcs) > 1 else srcs for srcs in inputs]  # stable
    shape_readers = {}  # unit -> single-op Shape/Size/Rank units reading only it
    for i, unit in enumerate(groups):
        if len(unit) == 1 and len(inputs[i]) == 1 and view.nodes[unit[0]].type in SHAPE_ONLY:
            shape_readers.setdefault(inputs[i][0], []).append(i)
    roots = [unit_of[split_tensor_name(t)[0]] for t in view.fetches
             if split_tensor_name(t)[0] in unit_of]
    roots += [unit_of[op] for op in view.targets if op in unit_of]
    roots += range(len(groups))  # every unit is reachable; this only guards that
    visited, order = [False] * len(groups), []
    for root in roots:
        if visited[root]:
            continue
        visited[root] = True
        stack = [(root, iter(inputs[root]))]
        while stack:
            unit, pending = stack[-1]
            for src in pending:
                if not visited[src]:
                    visited[src] = True
                    stack.append((src, iter(inputs[src])))
                    break
            else:
                stack.pop()
                order.append(unit)
                if unit in shape_readers:
                    for reader in shape_readers[unit]:
                        if not visited[reader]:
                            visited[reader] = True
                            order.append(reader)
    return order


def slice_order(groups, order, partition_size, cut=None):
    """Consecutive runs of the ordered units, each of at most partition_size ops; a
    partition starts at position `cut` of the order (None: nowhere in particular).

    Returns a list of partitions, each a tuple of units (tuples of op names).
    """
    partitions, current, size = [], [], 0
    for position, index in enumerate(order):
        unit = groups[index]
        if current and (size + len(unit) > partition_size or position == cut):
            partitions.append(tuple(current))
            current, size = [], 0
        current.append(unit)
        size += len(unit)
    if current:
        partitions.append(tuple(current))
    return partitions


def slice_order_mixed(groups, order, partition_size, fine_size, fine, cut=None):
    """As `slice_order`, but the units at the positions in `fine` (of `order`) in
    partitions of at most `fine_size` ops, apart from the others.

    Returns (partitions, positions): per partition its units, and the positions in
    `order` they hold."""
    return slice_order_sized(groups, order, [fine_size if position in fine else partition_size
                                             for position in range(len(order))], cut)


def slice_order_sized(groups, order, sizes, cut=None):
    """As `slice_order`, with a partition size per position of `order` (`sizes`): each
    partition holds positions of one size, at most that many ops.

    Returns (partitions, positions): per partition its units, and the positions in
    `order` they hold."""
    partitions, positions = [], []
    current, held, size, current_limit = [], [], 0, None
    for position, index in enumerate(order):
        unit, limit = groups[index], sizes[position]
        if current and (limit != current_limit or size + len(unit) > limit or position == cut):
            partitions.append(tuple(current))
            positions.append(tuple(held))
            current, held, size = [], [], 0
        current.append(unit)
        held.append(position)
        size += len(unit)
        current_limit = limit
    if current:
        partitions.append(tuple(current))
        positions.append(tuple(held))
    return partitions, positions


def partition(view, groups, partition_size):
    """The view's units (`groups`) as an ordered list of partitions (tuples of units)."""
    return slice_order(groups, depth_first_order(view, groups), partition_size)


def check_partition_size(value):
    """`value` as a partition size: a positive int, or "auto" (budget mode chooses); a
    ValueError naming what to give otherwise.  Both front ends check it at construction."""
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"partition_size must be a positive integer (the most ops "
                         f"one partition runs) or 'auto', got {value!r}")
    return int(value)
