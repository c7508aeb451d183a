"""Execute: run a rewritten plan, one Session call per stretch of partitions.

The Session front end of the step loop (`step_loop`, shared with tfmem.function).
The loop runs the plan's stretches (`plan/stretches.py`: partitions with
nothing swapped between them, one after another in one call); the plan itself
stays what is measured and reported, partition by partition.
Each stretch is a raw session callable per run options (the C++ path of
`Session.make_callable`, without its Python fetch handling, which would wrap
fetched handles in objects that free themselves later), or runs through
`Session.run`'s C path by name (c_path: with Options.calls_by_name, where measured
and untraced steps then share the executors TensorFlow built on the first call,
and for a distributed session's run metadata); a stretch whose originals read
connected tensors is always a callable.  Its feeds are the request's fed values and the handles of the transfers
it reads; its fetches are the transfers it produces (handles, or values to swap
out) and the requested tensors it computes.  The swap manager holds the transfers in
between; if a step fails it releases what the step held.
"""

import re
import threading
import time

import psutil
from tensorflow.core.protobuf import config_pb2

from tfmem.run.placement import accelerator

from tfmem.run.executing import c_path, partial_run

from tfmem.run.front_end import remote
from tfmem.run.measuring.call_peaks import CallPeaks
from tfmem.memory import oom
from tfmem.plan import updates
from tfmem.plan.schedule import Schedule
from tfmem.run.executing.step_loop import Wiring, run_step
from tfmem.run.executing.swap_manager import SwapManager
from tfmem.run.measuring.trace import NO_TIMELINE
from tfmem import tf_private


def _step_options(run_options, measure):
    """The RunOptions of a step's calls: the user's, with allocation tracking when the
    step measures (None: TensorFlow's defaults)."""
    if not measure or (run_options is not None and
                       run_options.trace_level >= config_pb2.RunOptions.SOFTWARE_TRACE):
        return run_options
    options = config_pb2.RunOptions()
    if run_options is not None:
        options.CopyFrom(run_options)
    options.trace_level = config_pb2.RunOptions.SOFTWARE_TRACE
    return options


def _callable_options(program, run_options, feed_order):
    options = config_pb2.CallableOptions(feed=[program.feeds[i] for i in feed_order],
                                         fetch=program.fetches, target=program.targets)
    for source, original_input in program.connections:  # see rewrite: originals
        options.tensor_connection.add(from_tensor=source, to_tensor=original_input)
    if run_options is not None:
        options.run_options.CopyFrom(run_options)
    return options


def _session_callable(session, program, run_options):
    """A raw session callable of `program`, fed in the order of its feed names: the order
    DirectSession builds `Session.run`'s executors in, which numbers the nodes as
    memory/op_order.py emulates.  Called with the feeds in the program's order."""
    order = sorted(range(len(program.feeds)), key=program.feeds.__getitem__)
    call = tf_private.make_callable(session, _callable_options(program, run_options, order))
    if order == sorted(order):
        return call

    def fed_by_name(*args, run_metadata=None):
        return call(*[args[i] for i in order], run_metadata=run_metadata)
    return fed_by_name


def _node_peaks(metadata):
    """(node name, the allocator's bytes in use at the node's peak) from step statistics.

    With allocation tracking on (SOFTWARE_TRACE), each op's statistics hold the
    allocator's bytes in use when it finished, and the bytes the op itself had
    allocated at its peak and still holds (its outputs); at the op's peak the
    allocator held `in use - live + peak`.
    """
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            for memory in node.memory:
                if memory.allocator_bytes_in_use:
                    yield node.node_name, (memory.allocator_bytes_in_use - memory.live_bytes
                                           + memory.peak_bytes)


def measured_peak(metadata):
    """The device allocator's peak during a run, from its step statistics, or None.

    This reads TensorFlow's own figures without resetting its process-wide peak
    (`get_memory_info()['peak']`), which belongs to the user.  On this machine it
    equals the allocator's peak of a freshly reset run to the byte when nothing
    else allocates meanwhile.
    """
    return max((value for _, value in _node_peaks(metadata)), default=None)


def _op_of(node_name, scope):
    """The plan's op a node of a call whose copies live under `scope` runs: a copy
    `<scope>/<op name>`, or the user's op itself (an original)."""
    prefix = scope + "/"
    return node_name[len(prefix):] if node_name.startswith(prefix) else node_name


def stage_peaks(metadata, scope, stage_of, stages):
    """Per stage of a call whose copies live under `scope` (see stretches), the peak of
    its ops' statistics, or None where none of them allocated; `stage_of`: {op: its
    stage}, or None for a call of one stage, which counts every op of the call."""
    if stage_of is None:
        return [measured_peak(metadata)]
    peaks = [None] * stages
    for name, value in _node_peaks(metadata):
        s = stage_of.get(_op_of(name, scope))
        if s is not None and (peaks[s] is None or value > peaks[s]):
            peaks[s] = value
    return peaks


def measured_scratch(metadata, ops, scope):
    """{op name: bytes its kernel allocated beyond what it returned} in a call whose `ops`
    ran as copies named `<scope>/<op name>`."""
    scratch = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            name = _op_of(node.node_name, scope)
            if name in ops and node.memory:
                extra = max(m.peak_bytes - m.live_bytes for m in node.memory)
                if extra > 0:
                    scratch[name] = max(extra, scratch.get(name, 0))
    return scratch


def _wiring(program):
    """The step loop's Wiring of a rewritten partition: fetch i goes to fetch_sinks[i]."""
    return Wiring(program.feed_sources,
                  tuple((i, kind, name) for i, (kind, name) in enumerate(program.fetch_sinks)))


class _Step:
    """One step's partition calls on the session: the step loop's front end (see step_loop).

    Made per step, since steps of one plan may run at once on different threads:
    it holds the callables of the step's run options, whether the step measures
    and its run metadata, and counts the executors TensorFlow built for it."""

    def __init__(self, executor, callables, run_metadata, measure, feeds, built=0):
        self.plan = executor.run_plan if callables is not None else executor.plan
        # (made only for a callable step: a partial-run step borrows only the diagnosis)
        self.wiring = executor.wiring if callables is not None else None
        self._executor = executor
        self._callables = callables
        self._run_metadata = run_metadata  # the step's run_metadata.StepMetadata, or None
        self._measure = measure  # read the device peak of each partition
        self._feeds = feeds  # the user's feeds (the partitions get the step's keys too)
        self.peaks = []  # per partition of the plan: peak bytes or None
        self.scratch = {}  # op name -> kernel scratch this step's statistics showed
        # executor sets TensorFlow built for this step: callables made for its run options,
        # and partitions run through Session.run for the first time (c_path)
        self.executors_built = built
        self.build_time = 0.0  # seconds of those first calls (running them included)

    def call(self, index, args):
        """Run callable `index` (a stretch of partitions); record each partition's device
        peak (None when not measured)."""
        call = self._callables[index]
        path = getattr(call, "path", None)  # a c_path.RunPathCallable's partition
        if path is None or path.built:
            return self._call(index, call, args)
        self.executors_built += 1  # (see c_path.RunPath.built)
        started = time.perf_counter()
        try:
            return self._call(index, call, args)
        finally:
            self.build_time += time.perf_counter() - started

    def _call(self, index, call, args):
        stages = self._executor.stages(index)
        if self._run_metadata is None and not self._measure:
            self.peaks.extend([None] * len(stages))
            return call(*args)
        record = self._executor.process_peak() if self._measure else None
        metadata = config_pb2.RunMetadata()
        values = call(*args, run_metadata=metadata)
        peaks = [None] * len(stages)
        if self._measure:
            peaks = self._executor.partition_peaks(index, metadata, record)
            self.scratch.update(self._executor.partition_scratch(index, metadata))
        if self._run_metadata is not None:
            self._run_metadata.add(metadata)
        self.peaks.extend(peaks)
        return values

    @staticmethod
    def host_value(value):
        return value  # a callable fetches numpy arrays already

    def out_of_memory(self, index, error):
        """The diagnosis reads the user's feeds (the partitions' also hold the step's keys)."""
        session = self._executor.session
        op = None  # (a partial run's failure cancels the session: no step runs again)
        if self._callables is not None:  # a callable runs a stretch: name its partition
            op = self._executor.failed_op(index, error)
            index = self._executor.failed_partition(index, error)
        memory = accelerator.device_memory(self._executor.device)
        return oom.device_memory_error(session, self._executor.plan, self._feeds, index, error,
                                       accelerator.device_capacity(session),
                                       self._executor.device,
                                       memory["current"] if memory else None, op)

    def failure(self, index, error):
        """A RemoteTaskError when a task of a distributed session was lost, else None."""
        return remote.lost_task_error(self._executor.remote_info, error, index,
                                      len(self.plan.partitions), updates.update_partitions(self.plan))


class Executor:
    """Runs the programs of one plan on one session."""

    def __init__(self, session, plan, programs, runtime, residence, partial=None,
                 run_plan=None, by_name=False, inherited=None):
        """`programs`: the callables' Programs, or a function making them when first
        needed (a plan whose steps run as partial runs: `partial`, see partial_run).
        `run_plan`: what the callables run, the plan's stretches (see stretches).
        `by_name`: run the partitions by name (c_path) where they can; False: session
        callables only, whose executors (and the constants their kernels hold) are
        freed with this executor, not kept by the session until it closes.
        `inherited`: {Program: {run options key: callable}} of programs an earlier
        plan compiled (see reuse): their callables are taken, not made again."""
        self._inherited = inherited or {}
        self.reused_calls = 0  # calls whose copies an earlier plan imported (see reuse)
        self.compiled = None  # its reuse.Compiled, where a later plan may take its calls
        self.session = session
        self.plan = plan
        self.run_plan = run_plan or plan
        self._programs = programs
        self._partial = partial  # partial_run.PartialRun, or None
        self._wiring = None  # see wiring
        self._runtime = runtime  # the session-wide pool, prefetcher and device
        self.remote_info = runtime.remote_info  # of a session on TF's distributed runtime
        self._residence = residence  # where the plan's kept tensors wait (see residence)
        self._callables = {}  # the step's RunOptions (see _step_options) -> list of callables
        self._run_paths = None  # per callable: its c_path.RunPath, or None (see _make_callables)
        self._by_name = by_name
        self._callables_lock = threading.Lock()  # concurrent first steps build them once
        # per callable: ((partition of the plan, its ops), ...) it runs, and {op: stage}
        # where it runs more than one (see stretches)
        self._stages = [p.stages or ((p.index, p.ops),) for p in self.run_plan.partitions]
        self._stage_of = [{op: s for s, (_, ops) in enumerate(stages) for op in ops}
                          if len(stages) > 1 else None for stages in self._stages]
        schedule = Schedule(plan)
        self._schedule = Schedule(self.run_plan) if self.run_plan is not plan else schedule
        self._partial_schedule = partial_run.schedule_for(schedule)
        uploads = {index: residence.upload_options(keys, [plan.view.tensor(t).dtype
                                                          for t, _ in keys])
                   for index, keys in enumerate(schedule.uploads) if keys}
        # Every op exists now: the callables below extend the session's graph once.  They
        # are the first step's: measured unless measuring is off.
        self.callables_made = 0  # session callables made at compile (the rest run by name)
        self.callables_taken = 0  # session callables taken from an earlier plan (inherited)
        if partial is None:
            _, self.callables_made = self._callables_for(
                None, measure=runtime.measure_device and runtime.measure != "off")
        self._batches = {index: runtime.prefetcher.batch(options)  # partition -> upload callable
                         for index, options in uploads.items()}
        # A stretch uploads only where its first partition does (see stretches).
        self._run_batches = {s: self._batches[self.stages(s)[0][0]]
                             for s, keys in enumerate(self._schedule.uploads) if keys}
        self._process = psutil.Process()
        self._ops = [frozenset(p.ops) for p in self.run_plan.partitions]

    @property
    def device(self):
        """The device the plan runs on ('CPU:0', 'GPU:0')."""
        return self._runtime.device

    @property
    def partial_run(self):
        """Whether steps that allow it run as one partial run (see partial_run)."""
        return self._partial is not None

    @property
    def programs(self):
        """The callables' Programs (copied into the graph on first use for a partial-run plan)."""
        if callable(self._programs):
            self._programs = self._programs()
        return self._programs

    @property
    def wiring(self):
        """Per partition, the step loop's Wiring of its callable (made with the programs)."""
        if self._wiring is None:
            self._wiring = [_wiring(p) for p in self.programs]
        return self._wiring

    def _callables_for(self, options, run_metadata=None, measure=False):
        """(the partitions' callables for these run options, how many session callables
        were made for them now): a measuring step's (allocation tracking on) apart, since
        tracking costs time on every step (see sampling).  By name where the executor
        runs calls so, and where a callable would lose the step's run metadata (c_path)."""
        options = _step_options(options, measure)
        by_name = self._by_name or c_path.wants_run_path(self.session, run_metadata)
        key = (options.SerializeToString(deterministic=True) if options is not None
               else b"", by_name)
        with self._callables_lock:
            if key in self._callables:
                return self._callables[key], 0
            if self._run_paths is None:
                self._run_paths = self._make_run_paths()
            paths = self._run_paths if by_name else [None] * len(self._run_paths)
            callables, made = self._make_callables(options, paths, key)
            self._callables[key] = callables
            return callables, made

    def _make_run_paths(self):
        """Per program, the RunPath that calls it by name, or None where its originals
        read connected tensors: TF_SessionRun cannot connect them (see rewrite), so such
        a partition stays a callable per run options, whose run metadata a distributed
        session drops (see c_path)."""
        programs = self.programs  # (a partial-run plan copies them into the graph now)
        tf_private.extend_graph(self.session)  # TF_SessionRun looks the names up there
        return [None if p.connections else c_path.RunPath(self.session, p) for p in programs]

    def _make_callables(self, options, paths, key):
        """(one callable per partition for these run options, how many session callables
        were made): by name where `paths` has its RunPath, else the callable an earlier
        plan made for the same program (`inherited`), else a new session callable."""
        callables, made = [], 0
        for program, path in zip(self.programs, paths):
            if path is not None:
                callables.append(path.calling(options))
                continue
            call = self._inherited.get(program, {}).get(key)
            if call is None:
                call, made = _session_callable(self.session, program, options), made + 1
            else:
                self.callables_taken += 1
            callables.append(call)
        return callables, made

    def callables_by_program(self):
        """{Program: {run options key: session callable}} made so far, for a later plan
        of the request to take (see reuse); calls by name need none."""
        by_program = {}
        for (options_key, by_name), callables in list(self._callables.items()):
            if by_name:
                continue
            for program, call in zip(self.programs, callables):
                by_program.setdefault(program, {})[(options_key, by_name)] = call
        return by_program

    def stages(self, index):
        """((partition of the plan, its ops), ...) that callable `index` runs."""
        return self._stages[index]

    def failed_op(self, index, error):
        """The plan's op that failed in callable `index`, or None where the error names
        none of its ops: a callable's error names the node in its message."""
        node = getattr(error, "node_def", None)
        if node is not None and node.name:
            name = node.name
        else:
            named = re.search(r"\{\{node ([^}]+)\}\}", error.message or "")
            name = named.group(1) if named else ""
        op = _op_of(name, self.programs[index].scope)
        return op if op in self._ops[index] else None

    def failed_partition(self, index, error):
        """The partition of the plan whose op failed in callable `index` (its first when
        the error names no op of it)."""
        stages = self.stages(index)
        op = self.failed_op(index, error)
        return next((i for i, ops in stages if op in ops), stages[0][0])

    def process_peak(self):
        """TensorFlow's process-wide peak on the device now (None: it keeps none)."""
        memory = accelerator.device_memory(self._runtime.device)
        return memory["peak"] if memory else None

    def partition_scratch(self, index, metadata):
        """{op name: kernel scratch} of partition `index`, from its step statistics."""
        return measured_scratch(metadata, self._ops[index], self.programs[index].scope)

    def partition_peaks(self, index, metadata, record_before):
        """The device peak of each partition callable `index` ran: from its step
        statistics (`metadata`), and TensorFlow's process peak when the call raised it
        above `record_before` (read, never reset: allocations of other threads, the
        prefetcher's uploads, count there and not in the statistics), given to the
        partition whose statistics peak highest.  Never above the process peak: the
        statistics' figure can be (an op's own peak added to the bytes in use when it
        finished, which ops running beside it may have raised since: 66-70 MiB read
        on a 51 MiB device)."""
        peaks = stage_peaks(metadata, self.programs[index].scope, self._stage_of[index],
                            len(self._stages[index]))
        memory = accelerator.device_memory(self._runtime.device)
        if memory is None:
            return peaks
        # a partition none of whose ops allocated held what was resident
        peaks = [memory["current"] if p is None else p for p in peaks]
        if record_before is not None and memory["peak"] > record_before:
            highest = peaks.index(max(peaks))
            peaks[highest] = max(peaks[highest], memory["peak"])
        return [min(p, memory["peak"]) for p in peaks]

    def run(self, feeds, options=None, run_metadata=None, timeline=None, measure=True):
        """Run one step; return ({requested tensor name: value}, StepStats).

        With a trace.Timeline, partitions, swap-outs, uploads and waits are recorded in it.
        `measure`: read the step's device peaks (where TensorFlow keeps figures), at the
        cost of allocation tracking; a step the user traces anyway is always measured.
        """
        timeline = timeline or NO_TIMELINE
        runtime = self._runtime
        traced = (options is not None
                  and options.trace_level >= config_pb2.RunOptions.SOFTWARE_TRACE)
        measure = runtime.measure_device and (measure or traced)
        keys = self._residence.for_step()  # the step's own tickets (see residence)
        # A measured step reads step statistics from the callables, except in budget mode,
        # which measures a partial run by the process figures (call_peaks) instead.
        call_peaks = CallPeaks(runtime.device) \
            if measure and runtime.measure_partial_runs else None
        if self._partial is not None and options is None and run_metadata is None \
                and (not measure or call_peaks is not None):  # (a partial run takes no RunOptions)
            step_run = partial_run.StepRun(self._partial, keys.inputs(feeds))
            swaps = partial_run.StoppingSwaps(SwapManager(
                self._partial_schedule, keys.bind(self._batches), runtime.pool,
                runtime.prefetcher, keys, timeline), step_run)
            if call_peaks is not None and not call_peaks.start_step():
                call_peaks = None  # TensorFlow keeps no figures now: nothing is measured
            step = partial_run.PartialStep(self._partial, step_run,
                                           _Step(self, None, None, False, feeds), call_peaks)
        else:
            step_run = call_peaks = None
            started = time.perf_counter()
            callables, made = self._callables_for(options, run_metadata, measure)
            swaps = SwapManager(self._schedule, keys.bind(self._run_batches), runtime.pool,
                                runtime.prefetcher, keys, timeline)
            step = _Step(self, callables, run_metadata, measure, feeds, made)
            if made:
                step.build_time = time.perf_counter() - started
        started = time.perf_counter()
        resident = None
        if call_peaks is not None:
            resident = call_peaks.resident
        elif measure and step_run is None:
            memory = accelerator.device_memory(runtime.device)
            resident = memory["current"] if memory else None
        try:
            results, call_time = run_step(step, swaps, keys.inputs(feeds), timeline)
        finally:
            if step_run is not None and step_run.failed is not None:
                runtime.cancelled_by = step_run.failed  # see partial_run: the session is gone
        wall = time.perf_counter() - started
        if call_peaks is not None:  # known where a call raised the process peak, else None
            measured = tuple(step.peaks)
            step_peak, bounds = call_peaks.step_peak(), call_peaks.step_bounds()
        else:
            measured = None if None in step.peaks or not step.peaks else tuple(step.peaks)
            step_peak, bounds = (max(measured) if measured else None), None
        stats = swaps.counts.step_stats(
            partitions=len(self.plan.partitions),
            calls=len(step.wiring),
            device_peak_bytes=step_peak,
            partition_peak_bytes=measured,
            measured=step_peak is not None or (measured is not None and
                                                any(p is not None for p in measured)),
            device_peak_bounds=bounds,
            resident_bytes=resident, kernel_scratch=step.scratch,
            host_buffer_bytes=runtime.pool.capacity_bytes,
            host_rss_bytes=self._process.memory_info().rss,
            wall_time=wall, call_time=call_time, partial_run=step_run is not None,
            setup_time=step_run.setup_time if step_run is not None else 0.0,
            executors_built=step.executors_built if step_run is None else 0,
            build_time=step.build_time if step_run is None else 0.0)
        return results, stats
