"""Step loop: one step of a plan, one call per partition, shared by both front ends.

    for each partition i:
        start the uploads whose span begins at i          (swap manager, prefetch thread)
        args = fed values, or the transfers i reads        (waits for their uploads)
        outs = front_end.call(i, args)                     (a Session callable, or a
                                                            ConcreteFunction call)
        each output: kept on the device, copied into a host buffer, or a result
        forget what i freed; deliver a Ctrl-C held during the call

A front end says how a partition is called and how tensors look to it:

    plan         the Plan it runs
    wiring       per partition a Wiring: what each argument is, where each output goes
    call(i, args)            the partition's outputs (a sequence)
    host_value(value)        a fetched output as the numpy array the swap manager copies
    out_of_memory(i, error)  the DeviceMemoryError to raise instead (it knows its feeds)
    failure(i, error)        another exception to raise instead of an OpError, or None
                             (for an out-of-memory error: the cause to chain)

The Session front end is `run/executing/execute.py`'s `_Step` (one per step of an
`Executor`), the eager one `tf2/execute.py`'s `_EagerStep` (of an
`EagerExecutor`); the swap manager (`run/executing/swap_manager.py`), which moves the
tensors, serves both.  A step that fails releases what it
held (`SwapManager.abort`) before the error propagates.
"""

import dataclasses
import time
import traceback

import tensorflow as tf

from tfmem.memory import oom
from tfmem.run.front_end.interrupts import deferred_interrupts
from tfmem.run.compiling.rewrite import HANDLE, HOST


@dataclasses.dataclass(frozen=True)
class Wiring:
    """How one compiled partition is fed and where its outputs go."""
    sources: tuple  # per argument: a fed tensor's name, or a transfer the swap manager holds
    sinks: tuple  # per use of an output: (output position, HANDLE | HOST | RESULT, tensor name)


def run_step(front_end, swaps, feeds, timeline):
    """Run every partition of `front_end` once; ({requested tensor: value}, seconds spent
    inside the partitions' calls).  `feeds`: {fed tensor name: value}."""
    results = {}
    in_calls = 0.0
    try:
        with deferred_interrupts() as deliver_interrupt:
            for index, wiring in enumerate(front_end.wiring):
                try:
                    in_calls += _run_partition(front_end, index, wiring, feeds, swaps,
                                               results, timeline)
                except tf.errors.ResourceExhaustedError as err:
                    if not oom.is_out_of_memory(err):
                        raise  # another exhausted resource (a queue, a quota): as TensorFlow said
                    swaps.abort()  # free the step's device memory before diagnosing,
                    # with the arguments the failed call's finished frames still hold (the
                    # diagnosis reads what the device holds without the step)
                    traceback.clear_frames(err.__traceback__)
                    # chained to TensorFlow's error as the front end would raise it (the
                    # eager one names the traced graph's ops, not the partition's)
                    raise front_end.out_of_memory(index, err) from (
                        front_end.failure(index, err) or err)
                except tf.errors.OpError as err:
                    replaced = front_end.failure(index, err)
                    if replaced is None:
                        raise
                    raise replaced from err
                deliver_interrupt()
    except BaseException:
        swaps.abort()
        raise
    return results, in_calls


def _run_partition(front_end, index, wiring, feeds, swaps, results, timeline):
    """Run partition `index` and hand its outputs over; the seconds its call took."""
    started = time.perf_counter()
    swaps.start_uploads(index)
    args = [feeds[s] if s in feeds else swaps.handle_for(s, index) for s in wiring.sources]
    called = time.perf_counter()
    values = front_end.call(index, args)
    in_call = time.perf_counter() - called
    args = None
    for position, kind, name in wiring.sinks:
        value = values[position]
        if kind == HANDLE:
            swaps.keep(name, value)
        elif kind == HOST:
            swaps.swap_out(name, front_end.host_value(value))
        else:
            results[name] = value
    # Fetched values can share TensorFlow's buffers: drop them so a swapped
    # tensor's device copy is freed before the next partition.
    values = value = None
    swaps.finish(index)
    part = front_end.plan.partitions[index]
    covered = [i for i, _ in part.stages] or [index]  # a stretch runs several (stretches)
    name = f"partition {covered[0]}" if len(covered) == 1 else \
        f"partitions {covered[0]}-{covered[-1]}"
    timeline.span("partitions", name, started, {"ops": len(part.ops), "partitions": len(covered)})
    return in_call
