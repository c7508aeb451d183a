"""Out of memory inside a partition: which partition, what it holds, and what would fit.

TensorFlow's own ResourceExhaustedError names a copied op and an allocation
size, which tells a user of tfmem little.  When a partition runs out of device
memory, the executor releases the step's handles and buffers and raises a
`DeviceMemoryError` built here: the partition's index and op count, its
largest tensors (sizes from the plan's shapes, resolved from the fed values),
the simulator's prediction for it, and a partition_size that the simulator
predicts fits the device beside what it already holds (found with
`budget.fit`; a budget advised holds that too), or, when nothing does, why.
"""

import dataclasses
import math

import tensorflow as tf

from tfmem.memory import budget
from tfmem import errors
from tfmem.plan.analyse import split_tensor_name
from tfmem.memory.concurrency import session_kernels_at_once
from tfmem.memory.sizing import Sizing
from tfmem.memory.simulate import TensorSizes, simulate, state_bytes
from tfmem.memory.sizes import mib

LARGEST = 3  # tensors named in the message
MAX_HALVINGS = 6  # how often the budget is halved while no smaller plan is found


def _budget_text(nbytes):
    return f"'{nbytes >> 20}MiB'" if nbytes % (1 << 20) == 0 else str(nbytes)


# How TensorFlow's allocators word a failed allocation (BFC, GPU, XLA).  TensorFlow
# appends a hint mentioning OOM to every ResourceExhaustedError, so "OOM" alone says nothing.
_ALLOCATION_FAILED = ("oom when allocating", "out of memory", "failed to allocate")


def _allocation_failure(error):
    """The line of the error's message that reports a failed allocation, or None."""
    for line in (error.message or "").splitlines():
        if any(words in line.lower() for words in _ALLOCATION_FAILED):
            return line.strip()
    return None


def requested_bytes(error):
    """Bytes of the tensor whose allocation failed, from the error's message, or None."""
    failed = errors.failed_tensor(error.message)
    if failed is None:
        return None
    shape, dtype = failed
    try:
        itemsize = tf.as_dtype(dtype).size
    except TypeError:
        return None
    return math.prod(shape) * itemsize


def modelled_request(plan, sizing, index, request, failed_op=None):
    """Whether the model sized an allocation of at least `request` bytes where partition
    `index` failed: an output, input or kernel scratch of the op that failed (of any op
    of the partition, or a transfer uploaded while it ran, when the op is not known).
    A request the model did not size (a tensor of unknown shape) says the bytes were
    missing from the prediction, whatever the allocator's layout."""
    if request is None:
        return False
    view = plan.view
    sizes = TensorSizes(view, sizing.shapes)
    ops = (failed_op,) if failed_op in view.nodes else plan.partitions[index].ops
    largest = 0
    for name in ops:
        node = view.nodes[name]
        tensors = [t for t in node.inputs if split_tensor_name(t)[0] in view.nodes]
        tensors += [f"{name}:{i}" for i in range(len(node.outputs))]
        largest = max([largest, sizing.scratch.get(name, 0)] + [sizes(t) for t in tensors])
    if failed_op not in view.nodes:
        largest = max([largest] + [sizes(t) for t in plan.partitions[index].uploads])
    return request <= largest


def is_out_of_memory(error):
    """Whether a ResourceExhaustedError is an allocation failure (not, say, a full queue)."""
    return _allocation_failure(error) is not None


def largest_tensors(plan, index, sizes, fed_bytes, count=LARGEST):
    """[(tensor, bytes)] the partition's ops read or write, largest first.

    `sizes` gives the bytes of a tensor of the plan, `fed_bytes` those of the feeds.
    """
    view = plan.view
    tensors = {}
    for name in plan.partitions[index].ops:
        node = view.nodes[name]
        for tensor in node.inputs:
            if tensor in fed_bytes:
                tensors[tensor] = fed_bytes[tensor]
            elif split_tensor_name(tensor)[0] in view.nodes:
                tensors[tensor] = sizes(tensor)
        for i in range(len(node.outputs)):
            tensors[f"{name}:{i}"] = sizes(f"{name}:{i}")
    ranked = sorted(tensors.items(), key=lambda item: (-item[1], item[0]))
    return [item for item in ranked if item[1] > 0][:count]


def suggest(plan, sizing, capacity, failed_peak, resident_bytes=0):
    """(partition_size, budget bytes, predicted peak, policy) of a plan predicted to fit, or None.

    `sizing`: the request's Sizing at the fed shapes.  `resident_bytes`: what the device
    holds while no step runs (its allocator's bytes in use); beyond the request's own
    state, which predictions count, it is taken off every budget tried (budget.fit), so
    a budget suggested holds it too.
    `failed_peak` is the simulator's peak for the partition that failed.  The
    budget starts at the device's capacity (or that peak, when the capacity is
    unknown); while the plan fitted to it is predicted to need no less than the
    failed partition (the simulator under-predicted it), the budget is halved.  With swap="none", swap="auto" is tried too:
    without swapping, every activation stays on the device.  When no plan is predicted
    under the failed partition (it failed below its prediction: another thread's
    uploads, the allocator's chunks), the most cautious plan that fitted is suggested.
    """
    policies = [plan.policy]
    if plan.policy.mode == "none":
        policies.append(dataclasses.replace(plan.policy, mode="auto"))
    cautious = None
    for policy in policies:
        target = capacity or failed_peak
        for _ in range(MAX_HALVINGS if target else 0):  # 0: the simulator could size nothing
            try:
                # advice names one partition_size: a plan of partitions all that size
                fitted, trace = budget.fit(plan.view, sizing, target, policy,
                                           resident_bytes=resident_bytes, coarsen=False)
            except errors.BudgetError:
                break
            cautious = fitted.partition_size, target, trace.peak_device, policy
            if trace.peak_device < failed_peak:
                return cautious
            target //= 2
    return cautious


def device_memory_error(session, plan, feeds, index, error, capacity, device, resident=None,
                        op=None):
    """The DeviceMemoryError for `error` (a ResourceExhaustedError) in partition `index`.

    `capacity`: the device's bytes (`accelerator.device_capacity`), or None; `device`:
    the one the plan ran on ('CPU:0', 'GPU:0'), which decides how many kernels may
    have held scratch at once (see concurrency); `resident`: the device's bytes in use
    once the failed step released its own, or None where TensorFlow keeps no figures;
    `op`: the plan's op that failed, when the error names it."""
    graph = session.graph
    shapes_fed = {name: getattr(value, "shape", ()) for name, value in feeds.items()}
    sizing = Sizing.of(graph, plan.view, shapes_fed, session,
                       session_kernels_at_once(device, session))
    sizes = TensorSizes(plan.view, sizing.shapes)
    fed_bytes = {name: getattr(value, "nbytes", 0) for name, value in feeds.items()}
    largest = largest_tensors(plan, index, sizes, fed_bytes)
    trace = simulate(plan, sizing.shapes, scratch=sizing.scratch, **sizing.simulate_options())
    ops = len(plan.partitions[index].ops)
    reason = _allocation_failure(error)
    lines = [f"partition {index} of {len(plan.partitions)} ({ops} ops, partition_size="
             f"{plan.partition_size}) ran out of device memory ({reason})."]
    if largest:
        lines.append("Its largest tensors: " + ", ".join(f"'{t}' {mib(n)}" for t, n in largest)
                     + ".")
    # what the device holds that the predictions do not count (the request's own state
    # they do): variables of other requests, a function's captured variables, other tensors
    others = max(resident - state_bytes(plan.view, sizes), 0) if resident else 0
    held = f" holding {mib(others)} the prediction does not count" if others else ""
    lines.append(f"The simulator predicts {mib(trace.partitions[index].device_peak)} for this "
                 f"partition and {mib(trace.peak_device)} for the step"
                 + (f", on a device of {mib(capacity)}{held}." if capacity else f"{held}."))
    # Candidates are fitted with budget mode's bound: compare them with the same bound.
    bound = budget.predict(plan, sizing)
    found = suggest(plan, sizing, capacity, bound.partitions[index].device_peak,
                    resident or 0)
    beside = f" beside the {mib(others)} the device holds" if others else ""
    if found:
        size, target, peak, policy = found
        swap = f", swap={policy.mode!r}" if policy.mode != plan.policy.mode else ""
        lines.append(f"Try partition_size={size}{swap} (predicted peak {mib(peak)}{beside}), "
                     f"or device_memory_budget={_budget_text(target)}{swap} to let tfmem "
                     "choose.")
        mode = policy.mode
    else:
        size = target = mode = None
        room = (f" in the {mib(max(capacity - others, 0))} the device has left{beside}"
                if capacity and others else "")
        lines.append("The simulator finds no plan predicted to fit (with tfmem's "
                     f"{budget.DEFAULT_MARGIN:.0%} margin){room}, even one op per partition: "
                     "shrink the batch or the largest tensors"
                     + (", or free what the device holds." if others else "."))
    return errors.DeviceMemoryError(" ".join(lines), node_def=error.node_def, partition=index,
                                    ops=ops, largest=largest, partition_size=size,
                                    budget=target, swap=mode, failed_op=op,
                                    request=requested_bytes(error))
