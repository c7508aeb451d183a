"""A planned request of a TFMemSession made runnable: predicted, checked, compiled.

    entry (plan_cache) --> its MemoryTrace (deferred while the plan swaps nothing: no
                           host buffers to check it against)
                       --> the host can hold its swapped tensors (host_memory)
                       --> an executor: shared with an entry of an equal plan, or the plan
                           copied into the session's graph (partial_run, plan_import,
                           rewrite) and made callable, but for the partitions an earlier
                           plan of the request compiled already (reuse); CompileStats of
                           what it cost
"""

import dataclasses
import functools
import logging
import time

from tfmem.memory import budget, first_updates, kernel_runner
from tfmem.memory.concurrency import session_kernels_at_once
from tfmem.memory.simulate import simulate
from tfmem.memory.sizing import Sizing
from tfmem.plan import stretches
from tfmem.plan.streams import StreamLedger
from tfmem.run.executing import partial_run
from tfmem.run.compiling import plan_import, reuse
from tfmem.run.executing.buffers import HostBufferPool
from tfmem.run.compiling.compile_stats import CompileStats
from tfmem.run.executing.execute import Executor
from tfmem.run.executing.host_memory import check_host_memory

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SessionRuntime:
    """What every plan of one session shares at run time."""
    device: str  # the device whose memory tfmem manages ("GPU:0", or "CPU:0")
    pool: HostBufferPool
    prefetcher: object  # prefetch.Prefetcher
    residence: object  # where kept tensors wait: residence.SessionHandles or WorkerStaging
    measure_device: bool  # TensorFlow keeps allocator figures (see accelerator.keeps_figures)
    measure: str = "sample"  # which steps are measured (Options.measure, see sampling)
    remote_info: object = None  # remote.RemoteInfo of a session on TF's distributed runtime
    partial_runs: bool = False  # steps of plans that allow it run as partial runs
    stretches: bool = True  # runs of partitions in one call (Options.stretches)
    one_import: bool = True  # a plan's copies in one import (Options.one_import)
    calls_by_name: bool = False  # calls through Session.run by name (Options.calls_by_name)
    cancelled_by: object = None  # the OpError of a failed partial-run step (see partial_run)
    # budget mode: a measured step stays a partial run, read by the process figures (call_peaks)
    measure_partial_runs: bool = False


class RequestCompiler:
    """Predicts and compiles the entries of one session's PlanCache (see the module
    docstring); `last_compile` is the CompileStats of the last entry compiled."""

    def __init__(self, session, runtime, plans, budget_bytes):
        self._session = session
        self._runtime = runtime
        self._plans = plans
        self._budget = budget_bytes
        self._streams = StreamLedger()  # which plan draws each seeded random stream
        self.last_compile = None
        if budget_bytes is not None:  # budget mode sizes every request, kernels measured
            kernel_runner.start()

    def sizing(self, view, feed_shapes):
        """The request's Sizing at these fed shapes (kernel scratch under this session's
        threads; on a CPU device, as many kernels at once as it has inter-op threads)."""
        concurrent = session_kernels_at_once(self._runtime.device, self._session)
        return Sizing.of(self._session.graph, view, feed_shapes, self._session, concurrent)

    def predict(self, plan, feed_shapes):
        """The plan's MemoryTrace at these fed shapes, kernel scratch included (in budget
        mode, the prediction budget mode plans with)."""
        sizing = self.sizing(plan.view, feed_shapes)
        if self._budget is not None:
            return budget.predict(plan, sizing)
        return simulate(plan, sizing.shapes, scratch=sizing.scratch, **sizing.simulate_options())

    def compile_entry(self, entry, request):
        """Predict the entry's memory (deferred when it swaps nothing), check the host's,
        and give it its executor (under the plan cache's lock)."""
        started = time.perf_counter()
        if not entry.predicted and not any(t.swapped for t in entry.plan.transfers):
            entry.defer_prediction(functools.partial(
                self.predict, entry.plan, request.feed_shapes()))
        elif entry.trace is None:
            entry.trace = self.predict(entry.plan, request.feed_shapes())
        simulated = time.perf_counter() - started
        if not entry.deferred:
            check_host_memory(entry.trace, self._runtime.pool)
        graph = self._session.graph
        if entry.written is None:
            entry.written = first_updates.written_variables(entry.plan.view)
            entry.assigned = first_updates.assigned(graph, entry.plan.view)
        donors = self._plans.executors(request.signature)
        if entry.replaced is not None:
            donors.append(entry.replaced)
        entry.executor = self._executor_for(entry, simulated, request.copy_time, donors)
        entry.replaced = None
        entry.graph_version = graph.version
        entry.feed_shapes = request.feed_shapes()

    def _executor_for(self, entry, simulate_time, copy_time, donors=()):
        """The executor of the entry's plan: shared with an entry of the same plan, or new,
        taking the partitions the `donors` (executors of the request's other plans)
        compiled already; a request that sets variables from constants takes none, since
        its executor is released after its first step (request_planner.note_buffers)."""
        shared = self._plans.executor_of(entry.plan)
        if shared is not None:
            self.last_compile = CompileStats(entry.plan_time, simulate_time, reused=True,
                                             copy_time=copy_time)
            return shared
        graph = self._session.graph
        before = graph.version
        # an initializing request runs callables, which release; a partial run's executor
        # stays in the session for good
        # an initializing request's constants are freed with its callables (see
        # request_planner.note_buffers): executors built by name live as long as the session
        executor, rewrite_time, extend_time, callables_time = self._compile(
            entry.plan, None if entry.deferred else entry.trace,
            self._runtime.partial_runs and not entry.assigned,
            by_name=self._runtime.calls_by_name and not entry.assigned,
            donors=() if entry.assigned else donors)
        calls = 0 if executor.partial_run else len(executor.run_plan.partitions)
        self.last_compile = CompileStats(
            entry.plan_time, simulate_time, rewrite_time, extend_time, callables_time,
            callables=calls,
            run_by_name=calls - executor.callables_made - executor.callables_taken,
            reused_calls=executor.reused_calls,
            graph_ops_before=before,
            partial_run=executor.partial_run,
            graph_ops_after=graph.version, copy_time=copy_time)
        log.info("compiled: %s", self.last_compile)
        return executor

    def _compile(self, plan, trace, partial_runs, by_name=False, donors=()):
        """(executor, rewrite, extend and callable seconds) of a plan copied into the graph,
        but for the partitions `donors` (executors) compiled already (see reuse)."""
        graph = self._session.graph  # finalized or not: see graph_growth
        with graph.as_default():
            scope = graph.unique_name("tfmem/plan", mark_as_used=True)
        self._streams.claim(graph, plan, scope)  # refuses a second stream of a copied op
        started = time.perf_counter()
        residence = self._runtime.residence.for_plan(scope)
        # one partial run per step where it serves, else callables (see partial_run)
        # the callables run the plan's stretches where the residence's ops allow it
        one_import = plan_import.imports_whole_plans(residence, self._runtime.one_import)
        run_plan = stretches.merged(plan) if one_import and self._runtime.stretches else plan
        compiled = [d.compiled for d in donors if d.compiled is not None]
        reused = reuse.reusable(run_plan, compiled) if one_import and compiled else {}
        partial, programs = partial_run.copy_plan(self._session, plan, scope, residence,
                                                  partial_runs, run_plan, one_import, reused)
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
        if partial is not None:
            reused = {}  # its callables are made when a step first needs them
        inherited = {}
        for donor in donors:
            for program, calls in donor.callables_by_program().items():
                inherited.setdefault(program, {}).update(calls)
        executor = Executor(self._session, plan, programs, self._runtime, residence, partial,
                            run_plan, by_name,
                            {p: inherited[p] for p in reused.values() if p in inherited})
        executor.reused_calls = len(reused)
        if partial is None and one_import:
            executor.compiled = reuse.Compiled(run_plan, programs)
        return (executor, rewritten - started, extended - rewritten,
                time.perf_counter() - extended)
