"""TFMemSession: a drop-in wrapper of a Session that runs requests in partitions.

    tfs = TFMemSession(sess, partition_size=200)
    _, loss = tfs.run([train_op, loss], feed_dict={x: batch})

`run` takes what `Session.run` takes and returns what it returns.  Each
distinct request (what is fetched, run and fed) is planned once
(request_planner); the plan is copied into the session's graph and compiled
into callables once (request_compiler), and later steps only run the executor
loop.  Budget mode's learning around steps is budget_learning's.  Variable
state lives in the wrapped session, so the plain session keeps working beside
the wrapper.
"""

import contextlib
import dataclasses
import functools
import logging
import time

from tfmem.memory import budget
from tfmem.memory.scratch import ScratchCache
from tfmem.plan.swap import SwapPolicy
from tfmem.run.placement import accelerator
from tfmem.run.executing import partial_run, residence
from tfmem.run.measuring import remeasure, sampling
from tfmem.run.front_end import remote
from tfmem.run.front_end import options as run_options
from tfmem.run.front_end.budget_learning import BudgetLearning
from tfmem.run.executing.buffers import HostBufferPool
from tfmem.run.measuring.memory_report import MemoryReport, session_report  # noqa: F401 (tfmem.MemoryReport)
from tfmem.run.front_end.plan_cache import PlanCache
from tfmem.run.executing.prefetch import Prefetcher
from tfmem.run.front_end.request import Request
from tfmem.run.compiling.request_compiler import RequestCompiler, SessionRuntime
from tfmem.run.front_end.request_planner import PlanSettings, RequestPlanner
from tfmem.run.front_end.run_metadata import StepMetadata
from tfmem.run.front_end.session_interface import SessionInterfaceMethods
from tfmem.run.front_end.step_record import StepRecord, listener_taking_records
from tfmem.run.measuring.trace import Timeline, write_chrome_trace
from tfmem import tf_private

log = logging.getLogger(__name__)


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
        accelerator's memory as the budget; what it learns from steps, and when
        it runs a step again, is budget_learning's.
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
        partial_runs, chain_copies, stretches, one_import, calls_by_name; see
        run/front_end/options.py).  Those settings given
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
        remote_info = remote.describe(sess)
        settings = PlanSettings.of(sess, partition_size, device_memory_budget,
                                   SwapPolicy(swap, swap_distance, prefetch,
                                              options.swap_min_bytes), options, remote_info)
        if _graph_copy is not None and _graph_copy.graph is not sess.graph:
            raise ValueError("_graph_copy must be the GraphCopy whose graph the session runs")
        self._session, self._copy, self._measure = sess, _graph_copy, options.measure
        self._steps = 0  # partitioned steps run, for StepStats.step
        # A session building cost models measures every step: its partitions then run the
        # same callables each step, whose step counts decide together which steps build
        # one (GraphOptions.build_cost_model: every N-th step of a request).
        config = tf_private.config_of(sess)
        self._builds_cost_model = config is not None and config.graph_options.build_cost_model > 0
        device = accelerator.memory_device(sess)
        measurable = accelerator.keeps_figures(device) and \
            (remote_info is None or remote_info.allocator_local)
        self._runtime = SessionRuntime(
            device, HostBufferPool(), Prefetcher(sess), residence.for_session(sess, device),
            measure_device=measurable, measure=options.measure, remote_info=remote_info,
            partial_runs=options.partial_runs, measure_partial_runs=settings.budget is not None,
            stretches=options.stretches, one_import=options.one_import,
            calls_by_name=options.calls_by_name)
        self._plans = PlanCache()  # each request planned once, compiled once
        self._compiler = RequestCompiler(sess, self._runtime, self._plans, settings.budget)
        remeasured = ScratchCache()  # kernels measured again after a step went over
        self._learning = BudgetLearning(
            settings.budget, sess, device, measurable,
            lambda entry: remeasure.request_scratch(sess, entry.plan.view, entry.feed_shapes,
                                                    remeasured),
            lambda entry: self._compiler.sizing(entry.plan.view, entry.feed_shapes))
        self._planner = RequestPlanner(sess, settings, self._plans, self._learning,
                                       self._compiler.sizing)
        self._trace_path = trace  # where each step's Chrome trace goes, or None
        self.last_step = None  # StepStats of the last run
        self._last_entry = None
        self._last_factor = 1.0
        self._step_listeners = []  # called as f(tfs, record) after every step
        self._planner.place_state()

    @property
    def _budget(self):
        """Budget mode's bytes, or None."""
        return self._planner.settings.budget

    @property
    def partition_size(self):
        return self._planner.settings.partition_size

    @property
    def last_compile(self):
        """The CompileStats of the last request planned and compiled."""
        return self._compiler.last_compile

    @property
    def session(self):
        """The wrapped session (of a tfmem.Session: the session it created, whose graph is
        a copy of what requests reach, see graph_copy; run the user's tensors through
        this TFMemSession)."""
        return self._session

    @property
    def graph(self):
        """The user's graph (for a tfmem.Session, the graph its session copies from)."""
        return self._session.graph if self._copy is None else self._copy.source

    @property
    def host_buffers(self):
        """The HostBufferPool swapped tensors wait in."""
        return self._runtime.pool

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
        """Call `listener(tfs, record)` after every step, from the thread that ran it
        (`record`: a tfmem.StepRecord of the step)."""
        self._step_listeners.append(listener_taking_records(listener))

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
            self._planner.place_state()

    def _check_open(self):
        if tf_private.is_closed(self._session):
            raise RuntimeError("Attempted to use a closed Session.")
        if self.graph.version == 0:
            raise RuntimeError("The Session graph is empty. Add operations to the "
                               "graph before calling run().")

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
        return self._compiler.predict(self._planner.entry(request).plan, request.feed_shapes())

    def plan(self, fetches, feed_dict=None):
        """The plan `run(fetches, feed_dict)` would execute, without running anything."""
        self._check_open()
        return self._planner.entry(self._request(fetches, feed_dict)).plan

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Run like `Session.run`, one partition at a time; `run_metadata` gets the whole
        step's (see run_metadata)."""
        self._check_open()
        if self._runtime.cancelled_by is not None:
            raise partial_run.cancelled_error(self._runtime.cancelled_by)
        request = self._request(fetches, feed_dict)
        compiled_before = self._compiler.last_compile

        def prepare():
            entry = self._planner.entry(request)
            self._plans.compile_once(entry, functools.partial(self._compiler.compile_entry,
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
        self._planner.note_buffers(entry)
        if self._budget is not None:
            self._learning.after_step(entry, stats)
        self._tell_listeners(entry, stats, compiled_before)
        return request.build_results(self._session, values)

    def _tell_listeners(self, entry, stats, compiled_before):
        planned, entry.newly_planned = entry.newly_planned, False
        if not self._step_listeners:
            return
        compiled = self._compiler.last_compile
        record = StepRecord(stats.step, stats, entry.plan, planned,
                            compiled if compiled is not compiled_before else None,
                            dict(entry.feed_shapes), lambda: entry.trace)
        for listener in self._step_listeners:
            listener(self, record)

    def memory_report(self):
        """A MemoryReport of the last step: measured and predicted device and host bytes."""
        if self.last_step is None:
            raise RuntimeError("memory_report() describes the last step; run a step first")
        return session_report(self.last_step, self._last_entry, self._last_factor,
                              self._budget)

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
