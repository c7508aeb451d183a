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
    makes them.

    Bit i of a mask stands for the i-th largest scratch, so the lowest bits of the ops
    independent of one are the largest scratches beside it: linear in the partition's
    ops and edges (times the masks' words), not quadratic in its kernels."""
    if concurrent_ops < 2:
        return {}
    heavy = [name for name in order if scratch.get(name)]
    if len(heavy) < 2:
        return {}
    by_size = sorted(range(len(heavy)), key=lambda i: (-scratch[heavy[i]], i))
    bit = {heavy[i]: 1 << rank for rank, i in enumerate(by_size)}
    size_at = [scratch[heavy[i]] for i in by_size]
    above = {}  # op -> bitmask of the heavy ops it is, or depends on, in the partition
    readers = {}  # op -> its readers in the partition
    for name in order:
        mask = bit.get(name, 0)
        for source in view.nodes[name].producers:
            if source in above:  # a loop's back edge: not yet seen, no path
                mask |= above[source]
                readers.setdefault(source, []).append(name)
        above[name] = mask
    below = {}  # op -> bitmask of the heavy ops it is, or that depend on it
    for name in reversed(order):
        mask = bit.get(name, 0)
        for reader in readers.get(name, ()):
            mask |= below[reader]
        below[name] = mask
    every = (1 << len(heavy)) - 1
    overlap = {}
    for name in heavy:
        independent = every & ~(above[name] | below[name])
        others = []
        while independent and len(others) < concurrent_ops - 1:
            lowest = independent & -independent
            others.append(size_at[lowest.bit_length() - 1])
            independent ^= lowest
        if others:
            overlap[name] = tuple(others)
    return overlap
