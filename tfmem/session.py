"""TFMemSession: a drop-in wrapper of a Session that runs requests in partitions.

    tfs = TFMemSession(sess, partition_size=200)
    _, loss = tfs.run([train_op, loss], feed_dict={x: batch})

`run` takes what `Session.run` takes and returns what it returns.  Each
distinct request (what is fetched, run and fed) is planned once; the plan
is copied into the session's graph and compiled into callables once, and
later steps only run the executor loop.  Variable state lives in the
wrapped session, so the plain session keeps working beside the wrapper.
"""

import contextlib
import dataclasses
import gc
import logging
import numbers
import threading
import time

import psutil

from tfmem import accelerator, budget
from tfmem.analyse import analyse
from tfmem.buffers import HostBufferPool
from tfmem.compile_stats import CompileStats
from tfmem.errors import HostMemoryError, TFMemError
from tfmem.execute import Executor
from tfmem.plan import make_plan
from tfmem.prefetch import Prefetcher
from tfmem.request import Request
from tfmem.rewrite import rewrite
from tfmem.shapes import resolve_shapes
from tfmem.simulate import simulate
from tfmem.trace import Timeline, write_chrome_trace
from tfmem.swap import SwapPolicy
from tfmem.swap_manager import HandleReleaser

log = logging.getLogger(__name__)


HOST_MARGIN = 0.1  # share of available host memory tfmem leaves free


def _check_partition_size(value):
    if value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"partition_size must be a positive integer (the most ops "
                         f"one partition runs) or 'auto', got {value!r}")
    return int(value)


def _budget_of(session, budget_value):
    """The device-memory budget in bytes: given, or the emulated cap / the GPU's memory."""
    if budget_value is not None:
        return budget.parse_bytes(budget_value)
    cap = accelerator.emulated_memory_mib()
    if cap is not None:
        return cap << 20
    limit = accelerator.accelerator_memory(session)
    if limit:
        return limit
    raise ValueError("partition_size='auto' needs a device_memory_budget (such as '2GiB') "
                     "on a session without an accelerator or an emulated cap")


@contextlib.contextmanager
def _gc_paused():
    """Planning allocates a few objects per op and frees none of them; the cyclic
    collector would scan them again every few hundred ops (a third of the time
    of planning a 100k-op graph)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Device and host memory of the last step, measured and predicted (bytes)."""
    device_peak: int | None  # TensorFlow's allocator peak; None where it keeps none
    predicted_device_peak: int  # the simulator's prediction for the plan
    device_budget: int | None
    host_buffers: int  # host bytes tfmem holds for swapped tensors
    predicted_host_peak: int
    host_rss: int
    host_available: int


@dataclasses.dataclass
class _Runtime:
    """What every plan of one session shares at run time."""
    device: str  # the device whose memory tfmem manages ("GPU:0", or "CPU:0")
    pool: HostBufferPool
    prefetcher: Prefetcher
    releaser: HandleReleaser
    measure_device: bool  # TensorFlow keeps allocator figures (a GPU, or the emulated cap)


class _Compiled:
    """A cached plan, its predicted memory, its executor once rewritten, and the graph
    version it was checked at."""

    def __init__(self, plan, graph_version, trace=None, plan_time=0.0):
        self.plan = plan
        self.graph_version = graph_version
        self.trace = trace
        self.executor = None
        self.plan_time = plan_time
        self.feed_shapes = None  # of the first run; the trace, if needed later, is for them


class TFMemSession:
    """Runs `Session.run` requests of `sess` as sequences of partitions.

    partition_size: the most ops one partition runs.
    swap: "auto" swaps a cross-partition tensor to host memory when its next
        reader is more than `swap_distance` partitions away; "all" swaps
        every one, "none" keeps all on the device.  On a CPU session with no
        emulated cap and no budget the device memory is host memory, and
        "auto" acts as "none".
    swap_min_bytes: in "auto" mode, tensors smaller than this stay on the device.
    prefetch: how many partitions ahead of its reader a swapped tensor is
        uploaded again (0: just before the reader, with no overlap).
    place_state_on_host: on a session with an accelerator, read large
        constants from host copies and report variables left on it (see place).
    trace: a path; each step's timeline is written there as a Chrome trace.
    device_memory_budget: bytes or a string like "2GiB".  tfmem then chooses
        the partition size and swap distance: the fewest partitions whose
        predicted peak fits (one, at plain speed, when the whole step fits).
        partition_size="auto" does the same with the emulated cap or the
        accelerator's memory as the budget.
    """

    def __init__(self, sess, partition_size=200, swap="auto", swap_distance=2, prefetch=1,
                 swap_min_bytes=1 << 20, place_state_on_host=True, trace=None,
                 device_memory_budget=None):
        if not hasattr(sess, "graph") or not hasattr(sess, "_make_callable_from_options"):
            raise TypeError(f"TFMemSession wraps a tf.compat.v1.Session, got {type(sess).__name__}")
        self._partition_size = _check_partition_size(partition_size)
        self._policy = SwapPolicy(swap, swap_distance, prefetch, swap_min_bytes)
        if device_memory_budget is not None or partition_size == "auto":
            self._partition_size = "auto"
            self._budget = _budget_of(sess, device_memory_budget)
        else:
            self._budget = None
        self._session = sess
        self._compiled = {}  # request signature -> _Compiled
        self._planning = threading.Lock()  # plans and graph additions, one thread at a time
        self._accelerator = accelerator.accelerator_of(sess) if place_state_on_host else None
        device = accelerator.memory_device(sess)
        measurable = device != "CPU:0" or accelerator.emulated_memory_mib() is not None
        if swap == "auto" and self._budget is None and not accelerator.has_own_memory(sess):
            # The "device" is host memory itself: a host copy would free nothing.
            self._policy = dataclasses.replace(self._policy, mode="none")
            log.info("swap='auto' on a CPU session without a memory cap or budget: "
                     "cross-partition tensors stay where they are (swap='all' forces swaps)")
        self._runtime = _Runtime(device, HostBufferPool(), Prefetcher(sess, device),
                                 HandleReleaser(sess), measure_device=measurable)
        self._trace = trace
        self.last_step = None  # StepStats of the last run
        self.last_compile = None  # CompileStats of the last request planned and compiled
        self._last_entry = None

    @property
    def session(self):
        """The wrapped session."""
        return self._session

    @property
    def graph(self):
        return self._session.graph

    @property
    def partition_size(self):
        return self._partition_size

    def _check_open(self):
        if getattr(self._session, "_closed", False):
            raise RuntimeError("Attempted to use a closed Session.")
        if self.graph.version == 0:
            raise RuntimeError("The Session graph is empty. Add operations to the "
                               "graph before calling run().")

    def _make_plan(self, request):
        """(plan, predicted trace or None) for the request under this session's settings."""
        with _gc_paused():
            if self._budget is None:
                return make_plan(request.fetch_tensors, request.targets, request.feeds,
                                 self._partition_size, self._policy, self._accelerator), None
            memory = (accelerator.device_memory(self._runtime.device)
                      if self._runtime.measure_device else None)
            return budget.fit(self.graph, request.fetch_tensors, request.targets,
                              request.feeds, request.feed_shapes(), self._budget, self._policy,
                              self._accelerator, resident_bytes=memory["current"] if memory else 0,
                              prefer=self._compiled_plans(request))

    def _compiled_plans(self, request):
        """Plans of this request already copied into the graph (budget mode: other shapes).

        A copy reads its shapes from what is fed, so it serves any shape whose
        predicted peak fits: reusing it keeps the graph from growing per shape.
        """
        plans = {id(e.plan): e.plan for key, e in self._compiled.items()
                 if e.executor is not None and key[:-1] == request.signature}
        return tuple(plans.values())

    def _entry(self, request):
        """The cached plan of the request, planned again if the graph changed what it reaches."""
        with self._planning:
            return self._entry_locked(request)

    def _entry_locked(self, request):
        key = request.signature
        if self._budget is not None:  # the fitting plan depends on the shapes fed
            key += (tuple(sorted(request.feed_shapes().items())),)
        entry = self._compiled.get(key)
        version = self.graph.version
        if entry is not None and entry.graph_version != version:
            fresh = analyse(request.fetch_tensors, request.targets, request.feeds)
            if fresh != entry.plan.view:
                log.info("graph changed under a cached request; planning it again")
                entry = None
            else:
                entry.graph_version = version
        if entry is None:
            started = time.perf_counter()
            plan, trace = self._make_plan(request)
            entry = self._compiled[key] = _Compiled(plan, version, trace,
                                                    time.perf_counter() - started)
        return entry

    def simulate(self, fetches, feed_dict=None):
        """The predicted MemoryTrace of one step of the request, without running it.

        Unknown dimensions are resolved from the shapes of the fed values.
        """
        self._check_open()
        request = Request(self.graph, fetches, feed_dict)
        plan = self._entry(request).plan
        return simulate(plan, resolve_shapes(self.graph, plan.view, request.feed_shapes()))

    def plan(self, fetches, feed_dict=None):
        """The plan `run(fetches, feed_dict)` would execute, without running anything."""
        self._check_open()
        return self._entry(Request(self.graph, fetches, feed_dict)).plan

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Run like `Session.run`, one partition at a time."""
        self._check_open()
        request = Request(self.graph, fetches, feed_dict)
        entry = self._entry(request)
        if entry.executor is None:
            with self._planning:
                if entry.executor is None:
                    started = time.perf_counter()
                    entry.feed_shapes = request.feed_shapes()
                    if entry.trace is None and any(t.swapped for t in entry.plan.transfers):
                        # Only swapped tensors take host buffers; without any, the
                        # prediction (seconds on a large request) waits for memory_report.
                        entry.trace = self._predict(entry)
                    simulated = time.perf_counter() - started
                    if entry.trace is not None:
                        self._check_host_memory(entry.trace)
                    entry.executor = self._executor_for(entry, simulated)
                    entry.graph_version = self.graph.version
        self._last_entry = entry
        timeline = Timeline() if self._trace else None
        values, self.last_step = entry.executor.run(
            request.feed_values_by_name(), options, run_metadata, timeline)
        if timeline:
            write_chrome_trace(timeline.events, self._trace)
        log.debug("step: %s", self.last_step)
        return request.build_results(self._session, values)

    def _predict(self, entry):
        """The predicted MemoryTrace of the entry's plan at the shapes it was compiled with."""
        return simulate(entry.plan, resolve_shapes(self.graph, entry.plan.view,
                                                   entry.feed_shapes))

    def _check_host_memory(self, trace):
        """Refuse, before anything runs, a plan whose host buffers the machine cannot hold."""
        available = psutil.virtual_memory().available
        needed = trace.peak_host - self._runtime.pool.capacity_bytes
        if needed > available * (1 - HOST_MARGIN):
            raise HostMemoryError(
                f"the plan needs {needed / (1 << 20):.0f} MiB of host memory for swapped tensors, "
                f"but only {available / (1 << 20):.0f} MiB is available (tfmem keeps "
                f"{HOST_MARGIN:.0%} free). Use a larger partition_size or swap_distance, "
                "swap='none', or free host memory.")

    def memory_report(self):
        """A MemoryReport of the last step: measured and predicted device and host bytes."""
        if self.last_step is None:
            raise RuntimeError("memory_report() describes the last step; run a step first")
        if self._last_entry.trace is None:
            self._last_entry.trace = self._predict(self._last_entry)
        trace = self._last_entry.trace
        return MemoryReport(
            device_peak=self.last_step.device_peak_bytes,
            predicted_device_peak=trace.peak_device,
            device_budget=self._budget,
            host_buffers=self.last_step.host_buffer_bytes,
            predicted_host_peak=trace.peak_host,
            host_rss=self.last_step.host_rss_bytes,
            host_available=psutil.virtual_memory().available)

    def _executor_for(self, entry, simulate_time):
        """The executor of the entry's plan: shared with an entry of the same plan, or new."""
        for other in self._compiled.values():
            if other.executor is not None and other.plan is entry.plan:
                self.last_compile = CompileStats(entry.plan_time, simulate_time, reused=True)
                return other.executor
        before = self.graph.version
        executor, rewrite_time, extend_time, callables_time = self._compile(entry.plan,
                                                                            entry.trace)
        self.last_compile = CompileStats(
            entry.plan_time, simulate_time, rewrite_time, extend_time, callables_time,
            callables=len(entry.plan.partitions), graph_ops_before=before,
            graph_ops_after=self.graph.version)
        log.info("compiled: %s", self.last_compile)
        return executor

    def _compile(self, plan, trace):
        """(executor, rewrite, extend and callable seconds) of a plan copied into the graph."""
        graph = self.graph
        if graph.finalized:
            raise TFMemError(
                "The session's graph is finalized, but tfmem adds the partition copies to it. "
                "Wrap the session before finalizing the graph (MonitoredSession and "
                "Supervisor finalize it).")
        with graph.as_default():
            scope = graph.unique_name("tfmem/plan", mark_as_used=True)
        started = time.perf_counter()
        programs = rewrite(graph, plan, scope)
        rewritten = time.perf_counter()
        swapped = [t for t in plan.transfers if t.swapped]
        log.info("plan %s: %d ops in %d partitions (partition_size=%s), %d tensors swapped "
                 "(%.1f MiB), predicted device peak %s",
                 scope, plan.num_ops, len(plan.partitions), plan.partition_size, len(swapped),
                 trace.bytes_to_host / (1 << 20) if trace else 0.0,
                 f"{trace.peak_device / (1 << 20):.1f} MiB" if trace else
                 "not predicted yet (nothing swapped; memory_report() predicts it)")
        extend = getattr(self._session, "_extend_graph", None)
        if extend is not None:  # the first callable would; timed apart from the callables
            extend()  # pylint: disable=not-callable
        extended = time.perf_counter()
        executor = Executor(self._session, plan, programs, self._runtime)
        return (executor, rewritten - started, extended - rewritten,
                time.perf_counter() - extended)

    @property
    def host_buffers(self):
        """The HostBufferPool swapped tensors wait in."""
        return self._runtime.pool

    def _release(self):
        self._compiled.clear()
        self._runtime.prefetcher.close()
        self._runtime.pool.clear()

    def close(self):
        """Close the wrapped session (as Session.close) and free tfmem's host buffers."""
        self._release()
        self._session.close()

    def __enter__(self):
        self._session.__enter__()
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        self._release()
        self._session.__exit__(exc_type, exc_value, traceback)
