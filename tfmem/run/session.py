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
import functools
import logging
import time

import psutil

from tfmem.run import accelerator, regrouping, report_text, sampling
from tfmem.run import options as run_options
from tfmem.memory import budget, first_updates
from tfmem.plan.analyse import analyse
from tfmem.plan.gc_pause import gc_paused
from tfmem.plan.partition import check_partition_size
from tfmem.run.budget_learning import BudgetLearning
from tfmem.run.buffers import HostBufferPool
from tfmem.run.compile_stats import CompileStats
from tfmem.run.execute import Executor
from tfmem.run.host_memory import check_host_memory
from tfmem.plan.place import place
from tfmem.run.placement_pass import Record, place_state_on_host
from tfmem.plan.build import make_plan
from tfmem.run.plan_cache import PlanCache
from tfmem.run.prefetch import Prefetcher
from tfmem.run.request import Request
from tfmem.run.run_metadata import StepMetadata
from tfmem.run.session_interface import SessionInterfaceMethods
from tfmem.memory.simulate import simulate
from tfmem.memory.sizing import Sizing
from tfmem.plan.streams import StreamLedger
from tfmem.run.trace import Timeline, write_chrome_trace
from tfmem.plan.swap import SwapPolicy
from tfmem.run import partial_run, plan_import, remote, residence as residences
from tfmem.run import remeasure
from tfmem.memory.concurrency import session_kernels_at_once
from tfmem.memory.scratch import ScratchCache
from tfmem.plan import stretches, updates
from tfmem import tf_private

log = logging.getLogger(__name__)


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
    # Per partition, kernel scratch included: the simulator's peaks, and TensorFlow's
    # measured ones (None where it keeps no figures).
    predicted_partition_peaks: tuple = ()
    partition_peaks: tuple | None = None
    # The last step, and the step whose measured figures (device_peak, partition_peaks)
    # these are: the plan's last measured one (None: none measured; see sampling).
    step: int = 0
    measured_step: int | None = None
    # The same predictions in BFC allocator chunks (simulate's device_peak_chunks), and
    # each partition's largest kernel scratch (counted in its peaks): the measured peak
    # usually lies in the band between the requested and the chunk figures.
    predicted_device_peak_chunks: int | None = None
    predicted_partition_peaks_chunks: tuple = ()
    partition_scratch: tuple = ()

    def __str__(self):
        return report_text.format_report(self)


@dataclasses.dataclass
class _Runtime:
    """What every plan of one session shares at run time."""
    device: str  # the device whose memory tfmem manages ("GPU:0", or "CPU:0")
    pool: HostBufferPool
    prefetcher: Prefetcher
    residence: object  # where kept tensors wait: residence.SessionHandles or WorkerStaging
    measure_device: bool  # TensorFlow keeps allocator figures (see accelerator.keeps_figures)
    remote_info: object = None  # remote.RemoteInfo of a session on TF's distributed runtime
    partial_runs: bool = False  # steps of plans that allow it run as partial runs
    cancelled_by: object = None  # the OpError of a failed partial-run step (see partial_run)
    # budget mode: a measured step stays a partial run, read by the process figures (call_peaks)
    measure_partial_runs: bool = False


class TFMemSession(SessionInterfaceMethods):
    """Runs `Session.run` requests of `sess` as sequences of partitions.

    A `SessionInterface`, accepted wherever TensorFlow accepts a session (see
    session_interface for what is partitioned and what goes straight through).
    `run(..., run_metadata=md)` fills `md` as plain `Session.run` would for the
    whole step (see run_metadata): step statistics only when a trace was asked
    for or a cost model built, one entry per device, partition graphs merged
    into one per device.  Wrapping an InteractiveSession leaves TensorFlow's
    default session as it is: `Tensor.eval()` runs on the InteractiveSession
    unless inside `with tfs.as_default():`.

    partition_size: the most ops one partition runs.
    device_memory_budget: bytes or a string like "2GiB".  tfmem then chooses
        the partition size and swap distance: the fewest partitions whose
        predicted peak fits (one, at plain speed, when the whole step fits).
        partition_size="auto" does the same with the emulated cap or the
        accelerator's memory as the budget.  A step that runs out of device
        memory before any op that changes state could have run (updates come
        late in a step) has changed nothing: it is planned again with what the
        failure taught and run again at once (see updates.unchanged_before).
    swap: "auto" swaps a cross-partition tensor to host memory when its next
        reader is more than `swap_distance` partitions away; "all" swaps
        every one, "none" keeps all on the device.  On a CPU session with no
        emulated cap and no budget the device memory is host memory, and
        "auto" acts as "none".
    prefetch: how many partitions ahead of its reader a swapped tensor is
        uploaded again (0: just before the reader, with no overlap).
    trace: a path; each step's timeline is written there as a Chrome trace.
    options: a tfmem.Options with the rarely changed settings (swap_min_bytes,
        place_state_on_host, accelerator_device, atomic_updates, measure,
        partial_runs, chain_copies; see run/options.py).  Those settings given
        as keyword arguments still work, with a DeprecationWarning.
    _graph_copy: tfmem.Session's own wiring: the session runs a
        `graph_copy.GraphCopy` of the user's graph, holding only what requests reach.
    """

    def __init__(self, sess, partition_size=200, swap="auto", swap_distance=2, prefetch=1, *,
                 device_memory_budget=None, trace=None, options=None, _graph_copy=None,
                 **deprecated):
        if not hasattr(sess, "graph") or not tf_private.makes_callables(sess):
            raise TypeError(f"TFMemSession wraps a tf.compat.v1.Session, got {type(sess).__name__}")
        options = run_options.resolve(options, deprecated, run_options.SESSION)
        self._partition_size = check_partition_size(partition_size)
        self._measure = options.measure
        self._steps = 0  # partitioned steps run, for StepStats.step
        # resource variables sharing no buffer with a kept constant (first_updates)
        self._owned = set()
        self._policy = SwapPolicy(swap, swap_distance, prefetch, options.swap_min_bytes)
        if device_memory_budget is not None or partition_size == "auto":
            remote.check_budget_source(sess, device_memory_budget is not None)
            self._partition_size = "auto"
            self._budget = accelerator.memory_budget(sess, device_memory_budget)
        else:
            self._budget = None
        self._session = sess
        if _graph_copy is not None and _graph_copy.graph is not sess.graph:
            raise ValueError("_graph_copy must be the GraphCopy whose graph the session runs")
        self._copy = _graph_copy
        # Fixed with the session's config: part of every view, so of every plan cached.
        self._regrouped_arithmetic = regrouping.session_regroups_arithmetic(sess)
        # A session building cost models measures every step: its partitions then run the
        # same callables each step, whose step counts decide together which steps build
        # one (GraphOptions.build_cost_model: every N-th step of a request).
        config = tf_private.config_of(sess)
        self._builds_cost_model = config is not None and config.graph_options.build_cost_model > 0
        self._plans = PlanCache()  # each request planned once, compiled once
        self._accelerator = accelerator.accelerator_of(sess, options.accelerator_device) \
            if options.place_state_on_host else None
        self._placed = Record()  # the placement pass's decisions on this session's graph
        device = accelerator.memory_device(sess)
        remote_info = remote.describe(sess)
        measurable = accelerator.keeps_figures(device) and \
            (remote_info is None or remote_info.allocator_local)
        self._atomic_updates = (remote.is_distributed(sess) if options.atomic_updates is None
                                else options.atomic_updates)
        # Copies are chained on a local session only: on TensorFlow's distributed runtime
        # a chain through ops of several tasks would run the tasks one after the other.
        # Nor in budget mode yet: its bound (the worst of the executor's orders, kernels
        # at once) is what its experiments validated; fitted to the chained order alone,
        # ResNet's quick search ran out of memory (docs/how-it-works.md, The memory model).
        self._chains_copies = (options.chain_copies and remote_info is None
                               and self._budget is None)
        if swap == "auto" and self._budget is None and not accelerator.has_own_memory(sess):
            # The "device" is host memory itself: a host copy would free nothing.
            self._policy = dataclasses.replace(self._policy, mode="none")
            log.info("swap='auto' on a CPU session without a memory cap or budget: "
                     "cross-partition tensors stay where they are (swap='all' forces swaps)")
        self._runtime = _Runtime(device, HostBufferPool(), Prefetcher(sess),
                                 residences.for_session(sess, device), measure_device=measurable,
                                 remote_info=remote_info, partial_runs=options.partial_runs,
                                 measure_partial_runs=self._budget is not None)
        # kernels measured again after a partial-run step went over (see remeasure)
        self._remeasured = ScratchCache()
        self._learning = BudgetLearning(
            self._budget, sess, device, measurable,
            lambda entry: remeasure.request_scratch(sess, entry.plan.view, entry.feed_shapes,
                                                    self._remeasured),
            lambda entry: self._sizing(entry.plan.view, entry.feed_shapes))
        self._trace_path = trace  # where each step's Chrome trace goes, or None
        self._streams = StreamLedger()  # which plan draws each seeded random stream
        self.last_step = None  # StepStats of the last run
        self.last_compile = None  # CompileStats of the last request planned and compiled
        self._last_entry = None
        self._last_factor = 1.0
        self._step_listeners = []  # called as f(tfs, entry, stats) after every step
        self._place_state()

    def _place_state(self):
        """Run the placement pass over ops it has not seen, before the session places them."""
        if self._accelerator is not None and self._graph.version and \
                not tf_private.is_closed(self._session):
            place_state_on_host(self._session, self._policy.min_bytes, self._placed)

    @property
    def session(self):
        """The wrapped session (of a tfmem.Session: the session it created, whose graph is
        a copy of what requests reach, see graph_copy; run the user's tensors through
        this TFMemSession)."""
        return self._session

    @contextlib.contextmanager
    def tracing(self, path):
        """Write each step run inside this block as a Chrome trace to `path` (the last
        step's stays), whatever `trace=` says; tools time some steps without tracing
        and trace others."""
        previous, self._trace_path = self._trace_path, path
        try:
            yield self
        finally:
            self._trace_path = previous

    def add_step_listener(self, listener):
        """Call `listener(tfs, entry, stats)` after every step, from the thread that ran it
        (`stats` is that step's StepStats)."""
        self._step_listeners.append(listener)

    @property
    def graph(self):
        """The user's graph (for a tfmem.Session, the graph its session copies from)."""
        return self._session.graph if self._copy is None else self._copy.source

    @property
    def _graph(self):
        """The session's graph, where plans are copied: the user's, or a GraphCopy's."""
        return self._session.graph

    def _request(self, fetches, feed_dict):
        """The call as a Request on the session's graph (copying what it reaches there)."""
        request = Request(self.graph, fetches, feed_dict)
        if self._copy is None:
            return request
        started = time.perf_counter()
        self._reach(request.ops())
        request = request.moved_to(self._copy)
        request.copy_time = time.perf_counter() - started
        return request

    def _reach(self, ops):
        """Copy what `ops` need into the GraphCopy, the placement pass over what is new."""
        if self._copy.reach(ops):
            self._place_state()

    @property
    def partition_size(self):
        return self._partition_size

    def _check_open(self):
        if tf_private.is_closed(self._session):
            raise RuntimeError("Attempted to use a closed Session.")
        if self.graph.version == 0:
            raise RuntimeError("The Session graph is empty. Add operations to the "
                               "graph before calling run().")

    def _predict(self, plan, request):
        """The plan's MemoryTrace for the request's fed shapes, kernel scratch included
        (in budget mode, the prediction budget mode plans with)."""
        return self._predict_shapes(plan, request.feed_shapes())

    def _predict_shapes(self, plan, feed_shapes):
        if self._budget is not None:
            return budget.predict(plan, self._sizing(plan.view, feed_shapes))
        sizing = self._sizing(plan.view, feed_shapes)
        return simulate(plan, sizing.shapes, scratch=sizing.scratch, **sizing.simulate_options())

    def _sizing(self, view, feed_shapes):
        """The request's Sizing at these fed shapes (kernel scratch under this session's
        threads; on a CPU device, as many kernels at once as it has inter-op threads)."""
        concurrent = session_kernels_at_once(self._runtime.device, self._session)
        return Sizing.of(self._graph, view, feed_shapes, self._session, concurrent)

    def _make_plan(self, request, correction=None, view=None):
        """(plan, predicted trace or None) for the request, with the placement pass's outcome.

        `view`: the request already analysed (after the placement pass), if it was."""
        self._place_state()
        plan, trace = self._plan_request(request, view, correction)
        placement = place(plan.view, self._accelerator, self._policy.min_bytes, self._placed)
        if plan.placement != placement:  # else keep the plan: it may be a compiled one
            plan = dataclasses.replace(plan, placement=placement)
        if self._atomic_updates:
            return updates.gather(plan, trace)
        return plan, trace

    def _plan_request(self, request, view, correction=None):
        """(plan, predicted trace or None) for the request under this session's settings,
        analysed here unless `view` is given."""
        with gc_paused():
            if view is None:
                view = analyse(request.fetch_tensors, request.targets, request.feeds,
                               self._regrouped_arithmetic, self._chains_copies)
            if self._budget is None:
                return make_plan(view, self._partition_size, self._policy,
                                 self._accelerator), None
            resident = (self._learning.device_in_use() or 0) + first_updates.pending_bytes(
                self._graph, view, self._owned)
            return budget.fit(view, self._sizing(view, request.feed_shapes()), self._budget, self._policy,
                              self._accelerator, resident_bytes=resident,
                              correction=correction,
                              prefer=self._plans.compiled_plans(request.signature))

    def _entry(self, request):
        """The cached plan of the request, planned again if the graph changed what it reaches."""
        with self._plans.lock:
            return self._entry_locked(request)

    def _entry_locked(self, request):
        key = request.signature
        if self._budget is not None:  # the fitting plan depends on the shapes fed
            key += (tuple(sorted(request.feed_shapes().items())),)
        entry = self._plans.get(key)
        version = self._graph.version
        if entry is not None and entry.graph_version != version:
            # Planned again (below) only when this differs, after the placement pass
            # has seen the new ops: then it is analysed once more, by _make_plan.
            fresh = analyse(request.fetch_tensors, request.targets, request.feeds,
                            self._regrouped_arithmetic, self._chains_copies)
            if fresh != entry.plan.view:
                log.info("graph changed under a cached request; planning it again")
                entry = None
            else:
                entry.graph_version = version
        if entry is not None and self._budget is not None and not entry.replan:
            entry.replan = self._learning.outgrown(entry)
        if entry is not None and entry.replan:
            entry.replan = False
            plan, trace = self._make_plan(request, entry.correction, entry.plan.view)
            if (plan.partition_size, plan.policy) != (entry.plan.partition_size,
                                                      entry.plan.policy):
                log.info("request planned again with the corrected model: %d partitions "
                         "(partition_size=%s), was %d", len(plan.partitions),
                         plan.partition_size, len(entry.plan.partitions))
                correction = entry.correction
                entry = self._plans.add(key, plan, version, trace)
                entry.correction = correction
            else:  # the same plan, predicted with what was learned (gather drops a stale trace)
                entry.trace = trace if trace is not None else budget.predict(
                    entry.plan, self._sizing(entry.plan.view, request.feed_shapes()),
                    entry.correction.scratch if entry.correction else None)
                if entry.schedule is not None:
                    entry.schedule.restart()  # measure every step until it settles again
        if entry is None:
            started = time.perf_counter()
            plan, trace = self._make_plan(request)
            entry = self._plans.add(key, plan, version, trace)
            entry.plan_time = time.perf_counter() - started
        return entry

    def partial_run_setup(self, fetches, feeds=None):
        """Passed straight to the session (see session_interface), on its graph's names."""
        if self._copy is None:
            return self._session.partial_run_setup(fetches, feeds)
        request = self._request(fetches, {})
        fed = [self.graph.as_graph_element(f, allow_tensor=True, allow_operation=False)
               for f in (feeds or [])]
        self._reach([t.op for t in fed])
        return self._session.partial_run_setup(request.run_names(), [t.name for t in fed])

    def partial_run(self, handle, fetches, feed_dict=None):
        """Passed straight to the session (see session_interface), on its graph's names."""
        if self._copy is None:
            return self._session.partial_run(handle, fetches, feed_dict)
        request = self._request(fetches, feed_dict)
        values = self._session.partial_run(handle, request.run_names(),
                                           request.feed_values_by_name())
        return request.build_results(
            self._session, dict(zip((t.name for t in request.fetch_tensors), values)))

    def simulate(self, fetches, feed_dict=None):
        """The predicted MemoryTrace of one step of the request, without running it.

        Unknown dimensions are resolved from the shapes of the fed values.
        """
        self._check_open()
        request = self._request(fetches, feed_dict)
        return self._predict(self._entry(request).plan, request)

    def plan(self, fetches, feed_dict=None):
        """The plan `run(fetches, feed_dict)` would execute, without running anything."""
        self._check_open()
        return self._entry(self._request(fetches, feed_dict)).plan

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Run like `Session.run`, one partition at a time; `run_metadata` gets the whole
        step's (see run_metadata)."""
        self._check_open()
        if self._runtime.cancelled_by is not None:
            raise partial_run.cancelled_error(self._runtime.cancelled_by)
        request = self._request(fetches, feed_dict)

        def prepare():
            entry = self._entry(request)
            self._plans.compile_once(entry, functools.partial(self._compile_entry,
                                                              request=request))
            return entry

        def execute(entry):
            self._last_entry = entry
            # the learned factor this step's plan was fitted with (learning may raise it after)
            self._last_factor = budget.learned_factor(entry.correction)
            timeline = Timeline() if self._trace_path else None
            # Session.run replaces run_metadata with the step's, and only when the step ran.
            step_metadata = StepMetadata(options) if run_metadata is not None else None
            if entry.schedule is None:
                entry.schedule = sampling.MeasureSchedule(self._measure)
            values, stats = entry.executor.run(
                request.feed_values_by_name(), options, step_metadata, timeline,
                measure=entry.schedule.wants() or self._builds_cost_model)
            return values, stats, timeline, step_metadata

        # (a partial run's failure cancelled the session: no next step to plan for)
        entry, (values, stats, timeline, step_metadata) = self._learning.run_step(
            prepare, execute, learns=lambda: self._runtime.cancelled_by is None)
        self._steps += 1
        stats = dataclasses.replace(stats, step=self._steps)
        entry.schedule.record(stats.partition_peak_bytes if stats.measured and
                              None not in stats.partition_peak_bytes else None)
        if stats.measured:
            entry.last_measured = stats
        self.last_step = stats
        if run_metadata is not None:
            run_metadata.CopyFrom(step_metadata.merged())
        if timeline:
            write_chrome_trace(timeline.events, self._trace_path)
        log.debug("step: %s", stats)
        self._note_buffers(entry)
        if self._budget is not None:
            self._learning.after_step(entry, stats)
        for listener in self._step_listeners:
            listener(self, entry, stats)
        return request.build_results(self._session, values)

    def _note_buffers(self, entry):
        """After a step of `entry`: which variables now own their buffers (first_updates).

        Its updates have copied what they shared.  An initializing request's executor
        keeps the constants it set variables from, sharing their buffers: released after
        its first step, they free, and the variables own their buffers, or share one
        among themselves (equal values merged), which costs nothing past the state: each
        copy replaces a share the state already counts.  Run again, it compiles once more
        and is kept (a request run every step must not compile every step)."""
        self._owned.update(entry.written)
        if not entry.assigned:
            return
        if entry.released:
            self._owned.difference_update(entry.assigned)
            return
        with self._plans.lock:
            entry.executor, entry.released = None, True
        self._owned.update(entry.assigned)
        log.info("released the executor of a request that set %d variables from constants: "
                 "the constants it kept are freed", len(entry.assigned))

    def memory_report(self):
        """A MemoryReport of the last step: measured and predicted device and host bytes."""
        if self.last_step is None:
            raise RuntimeError("memory_report() describes the last step; run a step first")
        trace = budget.scaled(self._last_entry.trace, self._last_factor)
        measured = self._last_entry.last_measured
        return MemoryReport(
            device_peak=measured.device_peak_bytes if measured else None,
            predicted_device_peak=trace.peak_device,
            device_budget=self._budget,
            host_buffers=self.last_step.host_buffer_bytes,
            predicted_host_peak=trace.peak_host,
            host_rss=self.last_step.host_rss_bytes,
            host_available=psutil.virtual_memory().available,
            predicted_partition_peaks=tuple(p.device_peak for p in trace.partitions),
            partition_peaks=measured.partition_peak_bytes if measured else None,
            step=self.last_step.step, measured_step=measured.step if measured else None,
            **report_text.trace_figures(trace))

    def _compile_entry(self, entry, request):
        """Predict the entry's memory (deferred when it swaps nothing), check the host's,
        and give it its executor (under the plan cache's lock)."""
        started = time.perf_counter()
        if not entry.predicted and not any(t.swapped for t in entry.plan.transfers):
            entry.defer_prediction(functools.partial(
                self._predict_shapes, entry.plan, request.feed_shapes()))
        elif entry.trace is None:
            entry.trace = self._predict(entry.plan, request)
        simulated = time.perf_counter() - started
        if not entry.deferred:
            check_host_memory(entry.trace, self._runtime.pool)
        if entry.written is None:
            entry.written = first_updates.written_variables(entry.plan.view)
            entry.assigned = first_updates.assigned(self._graph, entry.plan.view)
        entry.executor = self._executor_for(entry, simulated, request.copy_time)
        entry.graph_version = self._graph.version
        entry.feed_shapes = request.feed_shapes()

    def _executor_for(self, entry, simulate_time, copy_time):
        """The executor of the entry's plan: shared with an entry of the same plan, or new."""
        shared = self._plans.executor_of(entry.plan)
        if shared is not None:
            self.last_compile = CompileStats(entry.plan_time, simulate_time, reused=True,
                                             copy_time=copy_time)
            return shared
        before = self._graph.version
        # an initializing request runs callables, which release; a partial run's executor
        # stays in the session for good
        executor, rewrite_time, extend_time, callables_time = self._compile(
            entry.plan, None if entry.deferred else entry.trace,
            self._runtime.partial_runs and not entry.assigned)
        self.last_compile = CompileStats(
            entry.plan_time, simulate_time, rewrite_time, extend_time, callables_time,
            callables=0 if executor.partial_run else len(executor.run_plan.partitions),
            graph_ops_before=before,
            partial_run=executor.partial_run,
            graph_ops_after=self._graph.version, copy_time=copy_time)
        log.info("compiled: %s", self.last_compile)
        return executor

    def _compile(self, plan, trace, partial_runs):
        """(executor, rewrite, extend and callable seconds) of a plan copied into the graph."""
        graph = self._graph  # finalized or not: see graph_growth
        with graph.as_default():
            scope = graph.unique_name("tfmem/plan", mark_as_used=True)
        self._streams.claim(graph, plan, scope)  # refuses a second stream of a copied op
        started = time.perf_counter()
        residence = self._runtime.residence.for_plan(scope)
        # one partial run per step where it serves, else callables (see partial_run)
        # the callables run the plan's stretches where the residence's ops allow it
        run_plan = stretches.merged(plan) if plan_import.imports_whole_plans(residence) else plan
        partial, programs = partial_run.copy_plan(self._session, plan, scope, residence,
                                                  partial_runs, run_plan)
        rewritten = time.perf_counter()
        swapped = [t for t in plan.transfers if t.swapped]
        log.info("plan %s: %d ops in %d partitions (partition_size=%s), %d tensors swapped "
                 "(%.1f MiB), predicted device peak %s",
                 scope, plan.num_ops, len(plan.partitions), plan.partition_size, len(swapped),
                 trace.bytes_to_host / (1 << 20) if trace else 0.0,
                 f"{trace.peak_device / (1 << 20):.1f} MiB" if trace else "(predicted when read)")
        extend = getattr(self._session, "_extend_graph", None)
        if extend is not None:  # the first callable would; timed apart from the callables
            extend()  # pylint: disable=not-callable
        extended = time.perf_counter()
        executor = Executor(self._session, plan, programs, self._runtime, residence, partial,
                            run_plan)
        return (executor, rewritten - started, extended - rewritten,
                time.perf_counter() - extended)

    @property
    def host_buffers(self):
        """The HostBufferPool swapped tensors wait in."""
        return self._runtime.pool

    def _release(self):
        self._plans.clear()
        self._runtime.prefetcher.close()
        self._runtime.pool.clear()

    def close(self):
        """Close the wrapped session (as Session.close) and free tfmem's host buffers.

        The session closes first: a callable of an open session releases itself by an
        RPC when it is collected, which blocks for minutes against a dead distributed
        master; a closed session's callables skip it."""
        try:
            self._session.close()
        finally:
            self._release()
