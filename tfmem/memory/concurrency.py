"""Concurrency: kernel scratch that other ops of a partition may hold at the same time.

The simulator walks a partition in one order, one op at a time.  TensorFlow's CPU
executor runs ready ops on its inter-op threads, so two ops with no path between
them may run at once, each with its kernel scratch:

    a --> conv_grad_1 (24 MiB scratch) --> c
     \\--> conv_grad_2 (16 MiB scratch) --/      both at once: 40 MiB, not 24

Measured on ResNet-24 under a 113 MiB cap (2 inter-op threads): one plan's
partition peaked anywhere from 92 to 113.5 MiB from step to step against 97.5
predicted, and once ran out of memory on a 24 MiB convolution buffer.  So where
`concurrent_ops` (the session's inter-op threads on a CPU device) exceeds one,
each op's scratch is predicted with that of the largest `concurrent_ops - 1`
others it may overlap.  A GPU runs one kernel at a time: one there.

`kernels_at_once` is that rule, for every front end: `TFMemSession`, the
out-of-memory advice (their session's config) and `tfmem.function` (the eager
runtime's `tf.config.threading`) through `session_kernels_at_once`, `tfmem plan`
with its --inter-op-threads.
"""

import os

from tfmem import tf_private
from tfmem.plan.analyse import split_tensor_name


def configured_inter_op_threads(session=None):
    """The inter-op threads `session`'s config asks for; with no config (tfmem.function's
    stand-in session, or none) those of the eager runtime, which runs tf.functions."""
    config = tf_private.config_of(session)
    if config is not None:
        return int(config.inter_op_parallelism_threads)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return int(tf.config.threading.get_inter_op_parallelism_threads())


def kernels_at_once(device, threads):
    """How many kernels may run at once on `device` ('CPU:0', 'GPU:0') with `threads`
    inter-op threads configured: one on an accelerator; on a CPU the executor's pool,
    sized as TensorFlow sizes it (process_util.cc): 0 means TF_NUM_INTEROP_THREADS,
    else one per usable core; below 0, ops run in the caller's thread."""
    if not device.startswith("CPU"):
        return 1
    if threads == 0:
        from_env = os.environ.get("TF_NUM_INTEROP_THREADS", "").strip()
        threads = int(from_env) if from_env.isdigit() else 0
        threads = threads or len(os.sched_getaffinity(0))
    return max(threads, 1)


def session_kernels_at_once(device, session=None):
    """`kernels_at_once` on `device` with the threads `session` (None: the eager
    runtime) is configured with."""
    return kernels_at_once(device, configured_inter_op_threads(session))


def overlapping_buffers(view, order, scratch, concurrent_ops):
    """{op: the scratch buffers (bytes each, largest first) other ops of the partition
    (`order`, producers first) may hold while it runs}: the largest `concurrent_ops - 1`
    scratches of ops with no path to or from it, each its own allocation, as TensorFlow
    makes them."""
    if concurrent_ops < 2:
        return {}
    heavy = [name for name in order if scratch.get(name)]
    if len(heavy) < 2:
        return {}
    bit = {name: 1 << i for i, name in enumerate(heavy)}
    above = {}  # op -> bitmask of the heavy ops it is, or depends on, in the partition
    for name in order:
        node = view.nodes[name]
        mask = bit.get(name, 0)
        for source in {split_tensor_name(t)[0] for t in node.inputs} | set(node.control_inputs):
            mask |= above.get(source, 0)  # a loop's back edge: not yet seen, no path
        above[name] = mask
    overlap = {}
    for name in heavy:
        others = sorted((scratch[other] for other in heavy if other != name
                         and not above[name] & bit[other] and not above[other] & bit[name]),
                        reverse=True)
        if others:
            overlap[name] = tuple(others[:concurrent_ops - 1])
    return overlap
