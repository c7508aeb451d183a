"""Remeasure: kernel scratch for budget mode's learning.

When a step went over its prediction, the request's kernels are calibrated
again (tfmem.memory.scratch, in the kernel runner), past the process's cache.
A partial run has no step statistics; a step run as callables has them
(execute.measured_scratch), but they count the chunk the allocator handed each
kernel, not its request (a 27 MiB scratch buffer in a capped region's 52 MiB
tail reads 52), and the chunk replay models chunks already.  The planning
figures came from the process's cache, which may be stale (a `TFMEM_SCRATCH_CACHE` file written on another machine or
another TensorFlow).  Figures that differ replace the cache's and its file's,
as tfmem.function does, so the next process plans with them from its first
step.  Each kernel configuration is measured again once per session.
"""

from tfmem.memory.scratch import calibrate, default_cache


def request_scratch(session, view, feed_shapes, remeasured):
    """{op name: scratch bytes} of the request `view` at `feed_shapes`, measured again under
    `session`'s threads into `remeasured` (a ScratchCache, kept by the caller)."""
    seen = calibrate(session.graph, view, feed_shapes, session, cache=remeasured)
    default_cache().correct(remeasured)
    return seen
