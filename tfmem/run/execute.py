"""Execute: run a rewritten plan, one Session call per partition.

The loop is deliberately thin.  Each partition is a raw session callable
(the C++ path of `Session.make_callable`, without its Python fetch handling,
which would wrap fetched handles in objects that free themselves later).
Its feeds are the request's fed values and the handles of the transfers it
reads; its fetches are the transfers it produces (handles, or values to
swap out) and the requested tensors it computes.  The swap manager holds
the transfers in between; if a step fails it releases what the step held.
"""

import contextlib
import dataclasses
import signal
import threading
import time

import psutil
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem.run import accelerator, c_path, remote
from tfmem.memory import oom
from tfmem.plan import updates
from tfmem.run.rewrite import HANDLE, HOST
from tfmem.plan.schedule import Schedule
from tfmem.run.swap_manager import SwapManager
from tfmem.run.trace import NO_TIMELINE
from tfmem import tf_private


def _callable_options(program, run_options, measure):
    options = config_pb2.CallableOptions(feed=program.feeds, fetch=program.fetches,
                                         target=program.targets)
    for source, original_input in program.connections:  # see rewrite: originals
        options.tensor_connection.add(from_tensor=source, to_tensor=original_input)
    if run_options is not None:
        options.run_options.CopyFrom(run_options)
    if measure and options.run_options.trace_level < config_pb2.RunOptions.SOFTWARE_TRACE:
        options.run_options.trace_level = config_pb2.RunOptions.SOFTWARE_TRACE
    return options


def measured_peak(metadata):
    """The device allocator's peak during a run, from its step statistics, or None.

    With allocation tracking on (SOFTWARE_TRACE), each op's statistics hold the
    allocator's bytes in use when it finished, and the bytes the op itself had
    allocated at its peak and still holds (its outputs); at the op's peak the
    allocator held `in use - live + peak`.  This reads TensorFlow's own figures
    without resetting its process-wide peak (`get_memory_info()['peak']`), which
    belongs to the user.  On this machine it equals the allocator's peak of a
    freshly reset run to the byte when nothing else allocates meanwhile.
    """
    best = None
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            for memory in node.memory:
                if memory.allocator_bytes_in_use:
                    value = memory.allocator_bytes_in_use - memory.live_bytes + memory.peak_bytes
                    best = value if best is None else max(best, value)
    return best


def measured_scratch(metadata, ops, index):
    """{op name: bytes its kernel allocated beyond what it returned} in partition `index`
    whose `ops` ran as copies named `<scope>/p<index>/<op name>`."""
    scratch = {}
    marker = f"/p{index}/"
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            name = node.node_name.split(marker, 1)[-1]
            if name in ops and node.memory:
                extra = max(m.peak_bytes - m.live_bytes for m in node.memory)
                if extra > 0:
                    scratch[name] = max(extra, scratch.get(name, 0))
    return scratch


@contextlib.contextmanager
def _deferred_interrupts():
    """Hold Ctrl-C until a partition's outputs are handed over, then deliver it.

    A KeyboardInterrupt raised as a Session call returns would lose the
    handles it made.  The call itself cannot be interrupted anyway, so
    holding the signal until the partition boundary costs no responsiveness.
    Only the main thread receives signals; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))

    def deliver():
        if received:
            frame = received.pop()
            received.clear()
            if callable(previous):
                previous(signal.SIGINT, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

    try:
        yield deliver
    finally:
        signal.signal(signal.SIGINT, previous)
        deliver()


@dataclasses.dataclass
class _Step:
    """What every partition of one step reads and fills, passed as one object."""
    feeds: dict  # fed tensor name -> value
    swaps: SwapManager
    run_metadata: object  # the caller's RunMetadata, or None
    timeline: object  # a trace.Timeline, or trace.NO_TIMELINE
    measure: bool  # read the device peak of each partition
    results: dict = dataclasses.field(default_factory=dict)  # requested tensor -> value
    peaks: list = dataclasses.field(default_factory=list)  # per partition: peak bytes or None


class Executor:
    """Runs the programs of one plan on one session."""

    def __init__(self, session, plan, programs, runtime, residence):
        self._session = session
        self._plan = plan
        self._programs = programs
        self._runtime = runtime  # the session-wide pool, prefetcher and device
        self._residence = residence  # where the plan's kept tensors wait (see residence)
        self._one_step = threading.Lock() if residence.serial_steps else contextlib.nullcontext()
        self._callables = {}  # (RunOptions, measuring, run path) -> list of callables
        self._schedule = Schedule(plan)
        uploads = {index: residence.upload_options(keys, [plan.view.tensor(t).dtype
                                                          for t, _ in keys])
                   for index, keys in enumerate(self._schedule.uploads) if keys}
        # Every op exists now: the callables below extend the session's graph once.
        self._callables_for(None, measure=runtime.measure_device)
        self._batches = {index: runtime.prefetcher.batch(options)  # partition -> upload callable
                         for index, options in uploads.items()}
        self._process = psutil.Process()
        self._ops = [frozenset(p.ops) for p in plan.partitions]
        self.last_scratch = {}  # op name -> kernel scratch measured in the last step
        self.last_resident = None  # device bytes in use when the last step started

    def _callables_for(self, options, run_metadata=None, measure=False):
        """The partitions' callables for these run options; measuring ones (allocation
        tracking on) apart, since tracking costs time on every step (see sampling)."""
        serialized = options.SerializeToString(deterministic=True) if options is not None else b""
        run_path_wanted = c_path.wants_run_path(self._session, run_metadata)
        # run path: see c_path (keeps the step's run metadata)
        key = (serialized, bool(measure), run_path_wanted)
        if key not in self._callables:
            def make(program):
                callable_options = _callable_options(program, options, measure)
                # TF_SessionRun cannot connect tensors (see rewrite): such a partition
                # stays a callable, whose run metadata a distributed session drops
                if not run_path_wanted or program.connections:
                    return tf_private.make_callable(self._session, callable_options)
                return c_path.RunPathCallable(self._session, callable_options)

            self._callables[key] = [make(p) for p in self._programs]
        return self._callables[key]

    def _run_partitions(self, callables, step, deliver_interrupt):
        for index, (program, call) in enumerate(zip(self._programs, callables)):
            try:
                step.peaks.append(self._run_partition(index, program, call, step))
            except tf.errors.ResourceExhaustedError as err:
                if not oom.is_out_of_memory(err):
                    raise  # another exhausted resource (a queue, a quota): as TensorFlow said
                step.swaps.abort()  # free the step's device memory before diagnosing
                raise oom.device_memory_error(self._session, self._plan, step.feeds, index, err,
                                              accelerator.device_capacity(self._session)) from err
            except tf.errors.OpError as err:
                lost = remote.lost_task_error(self._runtime.remote_info, err, index,
                                              len(self._programs),
                                              updates.update_partitions(self._plan))
                if lost is None:
                    raise
                raise lost from err
            deliver_interrupt()

    def _run_partition(self, index, program, call, step):
        """Run one partition: feed its inputs, hand its outputs to the swap manager.

        Returns its measured device peak (None when not measured)."""
        started = time.perf_counter()
        swaps = step.swaps
        swaps.start_uploads(index)
        args = [step.feeds[s] if s in step.feeds else swaps.handle_for(s, index)
                for s in program.feed_sources]
        peak = None
        record = self._process_peak() if step.measure else None
        if step.run_metadata is not None or step.measure:
            metadata = config_pb2.RunMetadata()
            values = call(*args, run_metadata=metadata)
            if step.measure:
                peak = self._partition_peak(metadata, record)
                self.last_scratch.update(measured_scratch(metadata, self._ops[index], index))
            if step.run_metadata is not None:
                step.run_metadata.MergeFrom(metadata)
        else:
            values = call(*args)
        for (kind, name), value in zip(program.fetch_sinks, values):
            if kind == HANDLE:
                swaps.keep(name, value)
            elif kind == HOST:
                swaps.swap_out(name, value)
            else:
                step.results[name] = value
        # Fetched arrays can share TensorFlow's buffers: drop them so a
        # swapped tensor's device copy is freed before the next partition.
        values = value = None
        swaps.finish(index)
        step.timeline.span("partitions", f"partition {index}", started,
                           {"ops": len(self._plan.partitions[index].ops)})
        return peak

    def _process_peak(self):
        memory = accelerator.device_memory(self._runtime.device)
        return memory["peak"] if memory else None

    def _partition_peak(self, metadata, record_before):
        """The partition's device peak: from its step statistics, or TensorFlow's process
        peak when the partition raised it (read, never reset: allocations of other
        threads, the prefetcher's uploads, count there and not in the statistics)."""
        peak = measured_peak(metadata)
        memory = accelerator.device_memory(self._runtime.device)
        if memory is None:
            return peak
        if peak is None:  # no op of it allocated: it held what was resident
            peak = memory["current"]
        if record_before is not None and memory["peak"] > record_before:
            peak = max(peak, memory["peak"])
        return peak

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
        callables = self._callables_for(options, run_metadata, measure)
        swaps = SwapManager(self._schedule, self._batches, runtime.pool, runtime.prefetcher,
                            self._residence, timeline)
        started = time.perf_counter()
        step = _Step(feeds, swaps, run_metadata, timeline, measure)
        self.last_scratch = {}
        self.last_resident = None
        if measure:
            memory = accelerator.device_memory(runtime.device)
            self.last_resident = memory["current"] if memory else None
        with self._one_step:  # staging keys are per plan: one step at a time, abort included
            try:
                with _deferred_interrupts() as deliver_interrupt:
                    self._run_partitions(callables, step, deliver_interrupt)
            except BaseException:
                swaps.abort()
                raise
        wall = time.perf_counter() - started
        measured = None if None in step.peaks or not step.peaks else tuple(step.peaks)
        stats = swaps.counts.step_stats(
            partitions=len(self._programs),
            device_peak_bytes=max(measured) if measured else None,
            partition_peak_bytes=measured,
            measured=measured is not None,
            host_buffer_bytes=runtime.pool.capacity_bytes,
            host_rss_bytes=self._process.memory_info().rss,
            wall_time=wall)
        return step.results, stats
