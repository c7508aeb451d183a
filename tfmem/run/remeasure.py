"""Remeasure: kernel scratch for budget mode's learning where a step has no statistics.

A step run as callables with allocation tracking reports each op's scratch
(execute.measured_scratch), and budget mode takes it in when the step went
over its prediction.  A partial run reports none, so when a partial-run step
went over, the request's kernels are calibrated again (tfmem.memory.scratch),
past the process's cache: the planning figures came from that cache, which
may be stale (a `TFMEM_SCRATCH_CACHE` file written on another machine or
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
