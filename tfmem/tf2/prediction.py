"""What a tfmem.function step is predicted to hold: the shared memory model, eager's way.

The Session front end and budget mode predict from a request's `Sizing`
(tfmem.memory.sizing: shapes, kernel scratch calibrated once per kernel
configuration in the process's scratch cache, oneDNN max pooling's
workspaces, equal ops merged as Grappler merges them).  A tfmem.function
with a fixed partition size predicts from the same Sizing, so its
`.simulate()` and `memory_report()` count kernel scratch as budget mode does.

The one eager difference: each partition call holds its inputs until it
returns, so device copies are freed at their partition's end
(`early_frees=False`), the bound budget mode plans with too.  Kernels are
calibrated with TensorFlow's default threads (no Session config to read),
as budget mode's `Sizing` is: both share the cache entries.  On a CPU, as
many kernels may hold scratch at once as the eager runtime has inter-op
threads (`tf.config.threading`; see tfmem.memory.concurrency).

A fixed partition size needs no prediction to run, and the Sizing costs the
first call: 1.5-4 s on the benchmark Keras ResNet (53 kernel configurations,
under load; the scratch graph's import alone ~1.5 s with a warm cache), where
the whole first step takes 2.5 s on a quiet machine.  So `LazyPrediction`
makes it when first asked (`.simulate()`, `memory_report()`); the host memory
check before the first call reads the host figures, which kernel scratch does
not change, from the tensors-only trace made at once.
"""

import threading

from tfmem.memory.concurrency import session_kernels_at_once
from tfmem.memory.shapes import resolve_shapes
from tfmem.memory.simulate import simulate
from tfmem.memory.sizing import Sizing


def sizing(graph, view, feed_shapes, device):
    """The request's Sizing at `feed_shapes` on `device` ('CPU:0', 'GPU:0'), for the
    eager runtime: its threads decide how many kernels run at once there."""
    return Sizing.of(graph, view, feed_shapes,
                     concurrent_ops=session_kernels_at_once(device))


def predict(plan, request_sizing):
    """The MemoryTrace of one step of `plan` at a fixed partition size: the simulator's
    figures, kernel scratch included, inputs held to each partition's end.  (Budget
    mode's plans come with budget.predict's bound, the prediction they were fitted to.)"""
    return simulate(plan, request_sizing.shapes, early_frees=False,
                    scratch=request_sizing.scratch, **request_sizing.simulate_options())


class LazyPrediction:
    """The prediction of `plan` at `feed_shapes` on `device`, made on first `trace()`;
    its host figures (`peak_host`, `bytes_to_host`) known at once."""

    def __init__(self, graph, plan, feed_shapes, device):
        self._graph, self._plan, self._feed_shapes = graph, plan, feed_shapes
        self._device = device
        self._tensors = simulate(plan, resolve_shapes(graph, plan.view, feed_shapes),
                                 early_frees=False)  # no Sizing: host figures only
        self._trace = None
        self._lock = threading.Lock()

    @property
    def peak_host(self):
        return self._tensors.peak_host

    @property
    def bytes_to_host(self):
        return self._tensors.bytes_to_host

    def trace(self):
        """The MemoryTrace, kernel scratch included (calibrated now if not yet)."""
        with self._lock:
            if self._trace is None:
                self._trace = predict(self._plan, sizing(self._graph, self._plan.view,
                                                         self._feed_shapes, self._device))
            return self._trace


def resolved(trace):
    """A MemoryTrace from a trace or a LazyPrediction."""
    return trace.trace() if isinstance(trace, LazyPrediction) else trace
