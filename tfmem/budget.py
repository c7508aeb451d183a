"""Budget: the plan with the fewest partitions whose predicted step fits in device memory.

Users state how much device memory they have; tfmem finds the plan.  The
simulator predicts each candidate's peak, so the search runs no TensorFlow:

1. the whole step as one partition: if it fits, the step runs at plain
   TensorFlow's speed;
2. otherwise halve the partition size until a plan fits, then search between
   that size and the one above it for the largest that fits; at each size,
   try the user's swap distance first and shorter distances (more swapping)
   after;
3. if even one op per partition with every tensor swapped does not fit, say
   which op alone is too large.

Predictions must fit `budget * (1 - margin)`, and they are made with device
copies held to the end of each partition that frees them: the simulator is an
estimate, and on large models it under-predicts by more than the margin
(ResNet experiment: 53 MiB predicted, 64-68 MiB measured at 34 layers):
concurrent ops, kernel scratch memory, and constants Grappler folds into each
partition's executor, which stay resident, are not modelled.
"""

import dataclasses
import re

from tfmem.analyse import analyse, split_tensor_name
from tfmem.errors import BudgetError
from tfmem.partition import partition
from tfmem.place import place
from tfmem.plan import build_plan, validate
from tfmem.shapes import resolve_shapes
from tfmem.simulate import TensorSizes, simulate, state_bytes
from tfmem.swap import SwapPolicy
from tfmem.units import units

DEFAULT_MARGIN = 0.25
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12,
          "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value):
    """Bytes from an int or a string such as "2GiB", "512 MiB", "1.5GB", "1000"."""
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size: use bytes or a number "
                             "with a unit (B, KB, KiB, MB, MiB, GB, GiB, TB, TiB), e.g. '2GiB'")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"a memory size must be >= 0, got {value!r}")
    return int(number * _UNITS[unit])


def _mib(nbytes):
    return f"{nbytes / (1 << 20):.1f} MiB"


def _largest_op(view, size_of):
    """(name, type, bytes read and written) of the op that needs the most memory alone."""
    best = ("", "", 0)
    known = set(view.nodes) | set(view.sources)
    for name, node in view.nodes.items():
        total = sum(size_of(t) for t in node.inputs if split_tensor_name(t)[0] in known)
        total += sum(size_of(f"{name}:{i}") for i in range(len(node.outputs)))
        if total > best[2]:
            best = (name, node.type, total)
    return best


def fit(graph, fetch_tensors, target_ops, fed_tensors, feed_shapes, budget_bytes,
        policy=SwapPolicy(), accelerator=None, margin=DEFAULT_MARGIN, resident_bytes=0,
        prefer=()):
    """(plan, trace) of the largest partition size whose predicted peak fits the budget.

    `resident_bytes`: what the device holds already (its allocator's current bytes).
    Beyond the request's own variables and constants, which every prediction counts,
    it is taken off the budget: other requests' variables, tensors of other sessions.
    `prefer`: plans of the same request already compiled (for other feed shapes); the
    one with the fewest partitions that fits these shapes is returned, so its copies
    serve them and the session graph does not grow.
    """
    view = analyse(fetch_tensors, target_ops, fed_tensors)
    groups = units(view)
    shapes = resolve_shapes(graph, view, feed_shapes)
    placement = place(view, accelerator)
    others = max(resident_bytes - state_bytes(view, TensorSizes(view, shapes)), 0)
    limit = budget_bytes * (1 - margin) - others
    for plan in sorted(prefer, key=lambda p: len(p.partitions)):
        if plan.view == view and plan.placement == placement:
            trace = simulate(plan, shapes, early_frees=False)
            if trace.peak_device <= limit:
                return plan, trace
    distances = range(policy.swap_distance, -1, -1) if policy.mode == "auto" else [None]
    tried = {}

    def attempt(size):
        """The best-fitting plan at this partition size, or None."""
        if size not in tried:
            tried[size] = None
            for distance in distances:
                candidate = policy if distance is None else dataclasses.replace(
                    policy, swap_distance=distance)
                plan = build_plan(view, partition(view, groups, size), size, candidate, placement)
                trace = simulate(plan, shapes, early_frees=False)
                if trace.peak_device <= limit:
                    tried[size] = (plan, trace)
                    break
        return tried[size]

    whole = max(len(view.nodes), 1)
    size, fits = whole, attempt(whole)
    while fits is None and size > 1:
        size = max(size // 2, 1)
        fits = attempt(size)
    if fits is None:
        trace = simulate(build_plan(view, partition(view, groups, 1), 1,
                                    dataclasses.replace(policy, swap_distance=0), placement),
                         shapes, early_frees=False)
        name, kind, nbytes = _largest_op(view, TensorSizes(view, shapes))
        raise BudgetError(
            f"nothing fits in a device-memory budget of {_mib(budget_bytes)} (predictions must "
            f"stay under {_mib(limit)}"
            + (f", after {_mib(others)} the device holds for other requests" if others else "")
            + f"): even one op per partition needs {_mib(trace.peak_device)}"
            f", of which {_mib(trace.state_bytes)} is variables and constants. The largest op, "
            f"'{name}' ({kind}), alone reads and writes {_mib(nbytes)}. Raise the budget, or "
            "shrink the batch or that op.")
    low, high = size, min(size * 2, whole)  # low fits; search (low, high) for the largest fit
    while high - low > 1:
        middle = (low + high) // 2
        if attempt(middle) is None:
            high = middle
        else:
            low = middle
    plan, trace = tried[low]
    validate(plan)
    return plan, trace
