"""tfmem.function: a drop-in for `tf.function` that runs the traced step in partitions.

    @tfmem.function(partition_size=200)        # or device_memory_budget="2GiB"
    def train_step(x, y):
        ...
    loss = train_step(x, y)
    print(train_step.last_step)

Tracing is TensorFlow's own: the wrapper holds a real `tf.function` and asks
it for the ConcreteFunction of each call, so retracing rules, input
signatures and nested structures in and out are exactly tf.function's.  Each
ConcreteFunction's graph is then planned as a Session request would be
(fetches: its outputs; targets: its control outputs; feeds: its inputs and
captured handles), once per trace, and run eagerly one partition function
at a time (`tfmem.tf2`).  Variables are fed as the program's own captured
handles, so updates are shared both ways.

What runs as one unit: control flow inside the function (`tf.cond`,
`tf.while_loop` become single If/While ops) and calls of nested functions.
Refused: `jit_compile=True` (XLA compiles the whole function as one
cluster).  Called inside another `tf.function` (graph mode), or while a
GradientTape outside the call is recording, the wrapper runs the plain
`tf.function` as one call: a graph being built cannot be partitioned, and
partition calls are not recorded on an outer tape.
"""

import dataclasses
import functools
import logging
import threading
import weakref

import tensorflow as tf
from tensorflow.python.eager import record

from tfmem.run.placement import accelerator
from tfmem.memory import budget, kernel_runner, refine
from tfmem.run.front_end import options as run_options
from tfmem.run.front_end.budget_learning import BudgetLearning
from tfmem.run.executing.buffers import HostBufferPool
from tfmem.errors import UnsupportedGraphError
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan
from tfmem.plan.gc_pause import gc_paused
from tfmem.plan.partition import check_partition_size
from tfmem.run.executing.host_memory import check_host_memory
from tfmem.memory.resident import ResidentCheck
from tfmem.memory.scratch import ScratchCache, calibrate, default_cache
from tfmem.plan.swap import SwapPolicy
from tfmem import tf_private
from tfmem.tf2.compile import compile_partition, function_key, seen_names
from tfmem.tf2 import prediction
from tfmem.tf2.dedup import kept_copies
from tfmem.tf2.execute import EagerExecutor, GraphDevices
from tfmem.tf2.memory_report import function_memory_report
from tfmem.tf2.own_buffers import own_buffers, updated_variables
from tfmem.tf2.streams import TraceStreams, compile_with_streams
from tfmem.tf2.transfers import DroppedHandles, EagerPrefetcher
from tfmem.run.measuring.trace import Timeline, write_chrome_trace

log = logging.getLogger(__name__)

_HANDLE_DTYPES = (tf.resource, tf.variant)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The partitioning settings of one tfmem.function, checked once."""
    partition_size: object  # int, or "auto" (budget mode)
    policy: SwapPolicy
    budget: object  # the device_memory_budget as given, or None
    trace: object  # a path for Chrome traces, or None
    profile_peaks: bool = False  # each partition's peak every step, from the profiler


@dataclasses.dataclass
class _Runtime:
    """What every trace of one tfmem.function shares at run time."""
    device: str
    pool: HostBufferPool
    prefetcher: EagerPrefetcher
    releaser: DroppedHandles
    measure_device: bool
    policy: SwapPolicy
    budget_bytes: int | None
    profile_peaks: bool = False  # see tfmem.tf2.profiled_peaks


class _Traced:
    """One ConcreteFunction: its plan, predicted memory and compiled partitions."""

    def __init__(self, concrete, plan, trace):
        self.concrete = concrete  # kept alive: the cache is keyed by its id
        self.graph = concrete.graph
        self.input_names = tuple(t.name for t in self.graph.inputs)
        self.output_names = tuple(t.name for t in self.graph.outputs)
        self.plan = plan
        self.trace = trace
        self.executor = None
        # Budget mode: the request's Sizing, what its measured steps taught (carried to
        # the plans made after), and whether the next call plans again (see _learn).
        self.sizing = None
        self.feed_shapes = None
        self.correction = None
        self.replan = False
        self.resident = ResidentCheck()
        self.functions = {}  # function_key -> PartitionFunction of its executor's partitions
        self.functions_made = 0  # of them, compiled for this plan (the rest were shared)


def _refuse_jit(jit_compile):
    if jit_compile:
        raise UnsupportedGraphError(
            "tfmem.function cannot partition an XLA-compiled function (jit_compile=True): XLA "
            "compiles the whole function into one cluster, which tfmem cannot cut. Drop "
            "jit_compile (or set it to None/False) to run it through tfmem, or use "
            "tf.function(jit_compile=True) without tfmem.")


def function(func=None, *, partition_size=200, device_memory_budget=None, swap="auto",
             swap_distance=2, prefetch=1, trace=None, options=None, **tf_function_kwargs):
    """Like `tf.function`, but runs each traced step as a sequence of partitions.

    Works as `@tfmem.function`, `@tfmem.function(...)` and `tfmem.function(fn, ...)`.
    partition_size, device_memory_budget, swap, swap_distance, prefetch and trace
    mean what they mean for `TFMemSession`; `options` is a tfmem.Options, of which
    tfmem.function reads swap_min_bytes and profile_peaks (each partition's device
    peak every step from TensorFlow's profiler, see tfmem.tf2.profiled_peaks; it
    costs time per step).  Those two given as keyword arguments still work, with a
    DeprecationWarning.  Every other keyword (input_signature, reduce_retracing,
    autograph, ...) goes to `tf.function`.  jit_compile=True is refused
    (UnsupportedGraphError).
    """
    _refuse_jit(tf_function_kwargs.get("jit_compile"))
    deprecated = {k: tf_function_kwargs.pop(k) for k in OLD_KEYWORDS if k in tf_function_kwargs}
    options = run_options.resolve(options, deprecated, run_options.FUNCTION)
    size = check_partition_size(partition_size)
    policy = SwapPolicy(swap, swap_distance, prefetch, options.swap_min_bytes)
    if device_memory_budget is not None:
        budget.parse_bytes(device_memory_budget)  # a bad size fails here, not at the first call
        size = "auto"
    settings = _Settings(size, policy, device_memory_budget, trace, options.profile_peaks)
    if size == "auto":  # budget mode measures kernels when it first plans a trace
        kernel_runner.start()

    def decorate(python_function):
        return PartitionedFunction(python_function, settings, tf_function_kwargs)

    return decorate if func is None else decorate(func)


# Options fields tfmem.function took as keyword arguments (deprecated spellings).
OLD_KEYWORDS = ("swap_min_bytes", "profile_peaks")


def _budget_bytes(settings, devices):
    """The device-memory budget in bytes (budget mode), else None."""
    if settings.partition_size != "auto":
        return None
    return accelerator.memory_budget(devices, settings.budget)


def _make_runtime(settings):
    devices = GraphDevices(None)
    device = accelerator.memory_device(devices)
    budget_bytes = _budget_bytes(settings, devices)
    policy = settings.policy
    if policy.mode == "auto" and budget_bytes is None and not accelerator.has_own_memory(devices):
        # The "device" is host memory itself: a host copy would free nothing.
        policy = dataclasses.replace(policy, mode="none")
    measurable = accelerator.keeps_figures(device)  # the Session front end's rule
    return _Runtime(device, HostBufferPool(), EagerPrefetcher(device), DroppedHandles(),
                    measurable, policy, budget_bytes, settings.profile_peaks)


def _check_sources(view):
    """Constants are copied into each partition; other state must be captured, not made inside."""
    for name, node in view.sources.items():
        if node.type != "Const":
            raise UnsupportedGraphError(
                f"the traced function creates the state op '{name}' ({node.type}) inside its "
                "graph; tfmem.function runs partitions as separate functions and would create "
                "it once per partition. Create variables, tables and iterators outside the "
                "function and use them there (they are then captured).")


class PartitionedFunction:
    """A `tf.function` whose calls run in partitions.  See `tfmem.function`.

    Attributes: `last_step` (a StepStats of the last call), `tf_function`
    (the tf.function that traces), `host_buffers`.  `plan(*args)` and
    `simulate(*args)` describe a call without running it.
    """

    def __init__(self, python_function, settings, tf_function_kwargs, tf_function=None):
        self._python_function = python_function
        self._settings = settings
        self._tf_function_kwargs = dict(tf_function_kwargs)
        self._tf_function = tf_function or tf.function(python_function, **tf_function_kwargs)
        self._traced = {}  # (id of ConcreteFunction, shapes in budget mode) -> _Traced
        self._runtime = None
        self._learning = None  # budget mode's BudgetLearning, made with the runtime
        self._planning = threading.Lock()  # plans and compiles, one thread at a time
        self._bound = weakref.WeakKeyDictionary()  # instance -> its PartitionedFunction
        # (StepStats, the MemoryTrace predicted for the plan that ran it, the learned factor
        # it was fitted with)
        self._last = None
        self._remeasured = ScratchCache()  # kernel scratch measured again when learning
        self._streams = {}  # budget mode: id of ConcreteFunction -> its TraceStreams
        self._kept = {}  # id of ConcreteFunction -> dedup.kept_copies of its graph
        functools.update_wrapper(self, python_function, updated=())

    @property
    def last_step(self):
        """The StepStats of the last call (None before the first)."""
        last = self._last
        return last[0] if last is not None else None

    @property
    def tf_function(self):
        """The `tf.function` that traces the Python function."""
        return self._tf_function

    @property
    def python_function(self):
        return self._python_function

    @property
    def host_buffers(self):
        """The HostBufferPool swapped tensors wait in."""
        return self._runtime_now().pool

    def _runtime_now(self):
        if self._runtime is None:
            runtime = _make_runtime(self._settings)
            self._learning = BudgetLearning(
                runtime.budget_bytes, GraphDevices(None), runtime.device,
                runtime.measure_device, self._scratch_measured, lambda traced: traced.sizing,
                what=f"tfmem.function {self.__name__!r}")
            self._runtime = runtime
        return self._runtime

    def __get__(self, instance, owner):
        """Methods: one PartitionedFunction per instance, as tf.function does."""
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            bound = PartitionedFunction(
                self._python_function.__get__(instance, owner), self._settings,
                self._tf_function_kwargs, self._tf_function.__get__(instance, owner))
            self._bound[instance] = bound
        return bound

    def get_concrete_function(self, *args, **kwargs):
        """The ConcreteFunction tf.function traces for these arguments (run unpartitioned)."""
        return self._tf_function.get_concrete_function(*args, **kwargs)

    def _feeds(self, args, kwargs):
        """(ConcreteFunction, {graph input name: value}) for one call."""
        bound = tf_private.canonical_inputs(self._tf_function, args, kwargs)
        args, kwargs = bound.args, bound.kwargs
        concrete = self._tf_function.get_concrete_function(*args, **kwargs)
        function_type = concrete.function_type
        flat = function_type.unpack_inputs(function_type.bind(*args, **kwargs))
        values = list(flat) + list(concrete.captured_inputs)
        inputs = concrete.graph.inputs
        if len(values) != len(inputs):
            raise UnsupportedGraphError(
                f"tfmem.function could not match the {len(values)} arguments and captures of "
                f"this call to the {len(inputs)} inputs of the traced graph.")
        return concrete, {t.name: tf.convert_to_tensor(v) if not tf.is_tensor(v) else v
                          for t, v in zip(inputs, values)}

    def _key(self, concrete, feeds, runtime):
        key = (id(concrete),)
        if runtime.budget_bytes is not None:  # the fitting plan depends on the shapes fed
            key += tuple(tuple(v.shape) for v in feeds.values()
                         if v.dtype not in _HANDLE_DTYPES)
        return key

    @staticmethod
    def _feed_shapes(graph, feeds):
        """Shapes of fed values where the traced graph leaves dimensions unknown."""
        shapes = {}
        for tensor in graph.inputs:
            if tensor.dtype not in _HANDLE_DTYPES and not tensor.shape.is_fully_defined():
                shapes[tensor.name] = tuple(feeds[tensor.name].shape)
        return shapes

    def _traced_for(self, concrete, feeds):
        runtime = self._runtime_now()
        key = self._key(concrete, feeds, runtime)
        traced = self._traced.get(key)
        if traced is not None and traced.concrete is concrete:
            if runtime.budget_bytes is not None and not traced.replan:
                traced.replan = self._learning.outgrown(traced)
            return self._replanned(key, traced) if traced.replan else traced
        graph = concrete.graph
        input_names = {t.name for t in graph.inputs}
        fetches = list({t.name: t for t in graph.outputs if t.name not in input_names}.values())
        targets = list(graph.control_outputs)
        shapes = self._feed_shapes(graph, feeds)
        sizing, earlier = None, []
        with gc_paused():
            view = analyse(fetches, targets, graph.inputs)
            if runtime.budget_bytes is None:
                plan, trace = make_plan(view, self._settings.partition_size, runtime.policy), None
            else:
                # Plans of this trace for other shapes come first: one that fits these
                # shapes serves them with the same compiled partitions (nothing is compiled
                # again; random streams continue either way, see tfmem.tf2.streams).
                earlier = [t for t in self._traced.values() if t.concrete is concrete]
                if not earlier:  # the device holds what the first step will hold
                    own_buffers(updated_variables(concrete, view))
                sizing = prediction.sizing(graph, view, shapes, runtime.device)
                plan, trace = self._fit(view, sizing, None, earlier)
        _check_sources(plan.view)
        if trace is None:  # kernel scratch included, calibrated when first asked
            trace = prediction.LazyPrediction(graph, plan, shapes, runtime.device)
        traced = self._traced[key] = _Traced(concrete, plan, trace)
        traced.sizing, traced.feed_shapes = sizing, shapes
        return traced

    def _fit(self, view, sizing, correction, earlier):
        """Budget mode's (plan, trace) for the view, preferring the plans in `earlier`."""
        runtime = self._runtime
        resident = self._learning.device_in_use_for_planning(view, sizing) or 0
        return budget.fit(view, sizing, runtime.budget_bytes, runtime.policy,
                          resident_bytes=resident, correction=correction,
                          prefer=[t.plan for t in earlier], refine=refine.split_over_budget)

    def _replanned(self, key, traced):
        """Budget mode, after a step that measured over its prediction (see BudgetLearning): the
        plan fitted with the corrected model.  The step that went over is not run again."""
        earlier = [t for t in self._traced.values() if t.concrete is traced.concrete]
        with gc_paused():
            plan, trace = self._fit(traced.plan.view, traced.sizing, traced.correction, earlier)
        traced.replan = False
        if plan is traced.plan:  # still fits: the same plan, predicted with what was learned
            traced.trace = trace
            return traced
        log.info("tfmem.function %r planned again with the corrected model: %d partitions "
                 "(partition_size=%s), was %d", self.__name__, len(plan.partitions),
                 plan.partition_size, len(traced.plan.partitions))
        fresh = self._traced[key] = _Traced(traced.concrete, plan, trace)
        fresh.sizing, fresh.feed_shapes = traced.sizing, traced.feed_shapes
        fresh.functions = traced.functions  # until compiled: partitions the plans share
        fresh.correction = traced.correction
        return fresh

    def _scratch_measured(self, traced):
        """The trace's kernel scratch measured again, past the process's cache (which may
        be stale, or written on another machine), once per kernel configuration: eager
        TensorFlow keeps no step statistics of a function call to read it from, as the
        Session front end does (see tfmem.memory.scratch)."""
        seen = calibrate(traced.graph, traced.plan.view, traced.feed_shapes, None,
                         cache=self._remeasured)
        default_cache().correct(self._remeasured)  # and $TFMEM_SCRATCH_CACHE, for the next process
        return seen

    def _compile(self, traced):
        runtime = self._runtime
        check_host_memory(traced.trace, runtime.pool)
        plan = traced.plan
        for other in self._traced.values():
            if other.plan is plan and other.executor is not None:
                # Another shape of the same trace runs this plan (budget mode): its compiled
                # partitions serve both.
                traced.executor = other.executor
                return
        library = traced.graph.as_graph_def().library
        seen = seen_names(traced.concrete)
        if runtime.budget_bytes is None:  # one plan per trace: its partitions keep the streams
            kept = self._kept_copies(traced) if len(plan.partitions) > 1 else {}
            functions = [compile_partition(traced.graph, plan, p, library, seen, kept)
                         for p in plan.partitions]
            traced.functions_made = len(functions)
        else:  # plans per shape and re-plans: stream ops run in functions shared by all
            streams = self._streams.setdefault(id(traced.concrete), TraceStreams(traced.graph))
            cut = len(plan.partitions) > 1 or any(  # stream ops cut a partition too
                streams.draws(name) for p in plan.partitions for name in p.ops)
            kept = self._kept_copies(traced) if cut else {}
            functions = self._shared_functions(traced, lambda p: compile_with_streams(
                traced.graph, plan, p, library, seen, streams, kept), cut)
        swapped = [t for t in plan.transfers if t.swapped]
        log.info("%s: %d ops in %d partitions (partition_size=%s), %d tensors swapped "
                 "(%.1f MiB); %d partition functions made, %d taken from earlier plans",
                 self.__name__, plan.num_ops, len(plan.partitions), plan.partition_size,
                 len(swapped), traced.trace.bytes_to_host / (1 << 20),
                 traced.functions_made, len(plan.partitions) - traced.functions_made)
        traced.executor = EagerExecutor(traced.graph, plan, functions, runtime)

    def _shared_functions(self, traced, make, cut):
        """The functions of the traced plan's partitions: one an earlier plan of the trace
        compiled for an equal partition (`function_key`), else `make(partition)`.  Budget
        mode's plans of one trace (re-plans, other shapes) change a few partitions."""
        earlier = dict(traced.functions)
        for other in self._traced.values():
            if other.concrete is traced.concrete and other.executor is not None:
                earlier.update(other.functions)
        functions, traced.functions, traced.functions_made = [], {}, 0
        for p in traced.plan.partitions:
            key = function_key(p, cut)
            function = earlier.get(key)
            if function is None:
                function = make(p)
                traced.functions_made += 1
            traced.functions[key] = function
            functions.append(dataclasses.replace(function, index=p.index))
        return functions

    def _kept_copies(self, traced):
        """The copy of each equal computation Grappler keeps in the whole traced function,
        asked once per trace (see tfmem.tf2.dedup)."""
        key = id(traced.concrete)
        if key not in self._kept:
            self._kept[key] = kept_copies(traced.graph)
        return self._kept[key]

    def plan(self, *args, **kwargs):
        """The tfmem.Plan a call with these arguments runs (traced, not run)."""
        concrete, feeds = self._feeds(args, kwargs)
        with self._planning:
            return self._traced_for(concrete, feeds).plan

    def simulate(self, *args, **kwargs):
        """The predicted MemoryTrace of a call with these arguments, without running it."""
        concrete, feeds = self._feeds(args, kwargs)
        with self._planning:
            traced = self._traced_for(concrete, feeds)
        shapes = self._feed_shapes(traced.graph, feeds)
        if self._runtime.budget_bytes is not None or shapes == traced.feed_shapes:
            return prediction.resolved(traced.trace)  # what memory_report() reports
        return prediction.predict(traced.plan, prediction.sizing(
            traced.graph, traced.plan.view, shapes, self._runtime.device))

    def memory_report(self):
        """A FunctionMemoryReport of the last step: measured and predicted device and host
        bytes, as `TFMemSession.memory_report()`, plus the bytes resident when it started
        and bounds of its device peak (known also when the peak itself is not)."""
        last = self._last  # one read: the step and its plan's prediction, published together
        if last is None:
            raise RuntimeError("memory_report() describes the last step; call the function first")
        stats, trace, factor = last
        return function_memory_report(stats, budget.scaled(prediction.resolved(trace), factor),
                                      self._runtime.budget_bytes)

    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly() or record.could_possibly_record():
            # Building a graph, or a tape outside is recording: tf.function's own call, one
            # unit (partition calls are not recorded on tapes, and a graph cannot be cut here).
            return self._tf_function(*args, **kwargs)
        concrete, feeds = self._feeds(args, kwargs)
        self._runtime_now()

        def prepare():
            with self._planning:
                traced = self._traced_for(concrete, feeds)
                if traced.executor is None:
                    self._compile(traced)
            return traced

        def execute(traced):
            timeline = Timeline() if self._settings.trace else None
            # the prediction of this plan as it runs, and the factor it was fitted with
            # (learning may replace both)
            trace, factor = traced.trace, budget.learned_factor(traced.correction)
            return traced.executor.run(feeds, timeline), trace, factor, timeline

        traced, ((results, stats), trace, factor, timeline) = self._learning.run_step(
            prepare, execute, lock=lambda: self._planning)
        # one store: a concurrent call publishes a whole triple too
        self._last = (stats, trace, factor)
        if self._runtime.budget_bytes is not None:
            with self._planning:
                self._learning.after_step(traced, stats)
        if timeline:
            write_chrome_trace(timeline.events, self._settings.trace)
        log.debug("step: %s", stats)
        flat = [feeds[name] if name in feeds else results[name] for name in traced.output_names]
        return concrete.function_type.pack_output(flat)
