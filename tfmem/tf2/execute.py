"""Execute a plan eagerly: one ConcreteFunction call per partition.

The eager front end of the step loop (`tfmem.run.executing.step_loop`, shared with the
Session front end): arguments are the fed values (the function's inputs and
captured handles) and the transfers read (EagerTensors kept on the device,
or uploaded again by the prefetcher); outputs go to the shared SwapManager
(kept, or copied into a host buffer and dropped) or become the function's
results.  A step that fails releases everything it held; an out-of-memory
error becomes a `DeviceMemoryError` naming the partition and a setting
predicted to fit.
"""

import re
import time

import psutil
import tensorflow as tf

from tfmem.run.placement import accelerator
from tfmem.memory import oom
from tfmem.plan.schedule import Schedule
from tfmem.run.compiling.rewrite import HANDLE, HOST, RESULT
from tfmem.run.executing.step_loop import Wiring, run_step
from tfmem.run.executing.swap_manager import SwapManager
from tfmem.run.measuring.trace import NO_TIMELINE
from tfmem.tf2 import sorted_names
from tfmem.tf2.measure import PeakReader
from tfmem.tf2.profiled_peaks import ProfiledPeaks


class GraphDevices:
    """What `accelerator` and `oom` read of a session, for eager TensorFlow and a FuncGraph."""

    def __init__(self, graph):
        self.graph = graph

    def list_devices(self):
        return [_Device(d.device_type, d.name) for d in tf.config.list_logical_devices()]


class _Device:
    """A logical device; its memory limit is looked up only when asked for (budget mode)."""

    def __init__(self, device_type, name):
        self.device_type, self.name = device_type, name

    @property
    def memory_limit_bytes(self):
        from tensorflow.python.client import device_lib  # pylint: disable=import-outside-toplevel
        for device in device_lib.list_local_devices():
            if device.name.endswith(self.name.split("device:", 1)[-1]):
                return device.memory_limit
        return None


def _wiring(plan, function):
    """The step loop's Wiring of a PartitionFunction: an output may be kept, swapped
    and returned at once (one EagerTensor serves all three)."""
    fetched = frozenset(plan.view.fetches)
    transfers = frozenset(plan.partitions[function.index].outputs)
    sinks = []
    for position, name in enumerate(function.output_sinks):
        if name in transfers:
            transfer = plan.transfer(name)
            if transfer.kept:
                sinks.append((position, HANDLE, name))
            if transfer.swapped:
                sinks.append((position, HOST, name))
        if name in fetched:
            sinks.append((position, RESULT, name))
    return Wiring(function.input_sources, tuple(sinks))


class _EagerStep:
    """One step's partition calls: the step loop's front end (see tfmem.run.executing.step_loop)."""

    def __init__(self, executor, peaks, feeds):
        self.plan = executor.plan
        self.wiring = executor.wiring
        self._executor = executor
        self._peaks = peaks  # a PeakReader, or None where TensorFlow keeps no figures
        self._feeds = feeds  # {argument name: value}

    def call(self, index, args):
        function = self._executor.functions[index]
        if self._peaks is None:
            return function.call(*args)
        self._peaks.start_partition()
        values = function.call(*args)
        self._peaks.end_partition()
        return values

    @staticmethod
    def host_value(value):
        return value.numpy()

    def out_of_memory(self, index, error):
        shapes = {name: value for name, value in self._feeds.items()
                  if value.dtype not in (tf.resource, tf.variant)}
        devices = GraphDevices(self._executor.graph)
        memory = accelerator.device_memory(self._executor.device)
        return oom.device_memory_error(devices, self.plan, shapes, index, error,
                                       accelerator.device_capacity(devices),
                                       self._executor.device,
                                       memory["current"] if memory else None,
                                       self._failed_op(index, error))

    def _failed_op(self, index, error):
        """The plan's op of partition `index` the error names, or None (a partition
        function names its nodes as sorted_names encodes them)."""
        named = re.search(r"\{\{node ([^}]+)\}\}", error.message or "")
        op = sorted_names.decode(named.group(1)) if named else None
        return op if op in self.plan.partitions[index].ops else None

    def _is_op_name(self, name):
        try:
            self._executor.graph.get_operation_by_name(name)
        except (KeyError, ValueError):
            return False
        return True

    def failure(self, index, error):
        """An eager step has no remote task to lose: TensorFlow's error, in the traced
        graph's op names (a partition's nodes are named by tfmem.tf2.sorted_names)."""
        del index
        message = sorted_names.readable_message(error.message, self._is_op_name)
        if message == error.message:
            return None
        try:  # every subclass takes (node_def, op, message); OpError itself a code too
            return type(error)(error.node_def, error.op, message)
        except TypeError:
            return None


class EagerExecutor:
    """Runs the PartitionFunctions of one plan of one traced graph."""

    def __init__(self, graph, plan, functions, runtime):
        self.graph = graph
        self.plan = plan
        self.functions = functions
        self.wiring = [_wiring(plan, f) for f in functions]
        self._runtime = runtime  # pool, prefetcher, releaser, device, measure_device
        self._schedule = Schedule(plan)
        self._batches = {index: runtime.prefetcher.batch
                         for index, keys in enumerate(self._schedule.uploads) if keys}
        self._process = psutil.Process()

    @property
    def device(self):
        """The device the plan runs on ('CPU:0', 'GPU:0')."""
        return self._runtime.device

    def run(self, feeds, timeline=None):
        """Run one step on {fed tensor name: EagerTensor}; return ({fetch: value}, StepStats)."""
        timeline = timeline or NO_TIMELINE
        runtime = self._runtime
        swaps = SwapManager(self._schedule, self._batches, runtime.pool, runtime.prefetcher,
                            runtime.releaser, timeline)
        peaks = None
        if runtime.measure_device:
            peaks = (ProfiledPeaks if getattr(runtime, "profile_peaks", False) else PeakReader)(
                runtime.device)
        if peaks is not None and not peaks.start_step():
            peaks = None  # TensorFlow keeps no figures for this device
        started = time.perf_counter()
        try:
            results, call_time = run_step(_EagerStep(self, peaks, feeds), swaps, feeds, timeline)
        finally:
            if peaks is not None:
                peaks.finish_step()  # the profiler stops also when the step fails
        wall = time.perf_counter() - started
        stats = swaps.counts.step_stats(
            partitions=len(self.functions), calls=len(self.functions),
            device_peak_bytes=peaks.step_peak() if peaks is not None else None,
            partition_peak_bytes=tuple(peaks.partition_peaks) if peaks is not None else None,
            resident_bytes=peaks.resident if peaks is not None else None,
            device_peak_bounds=peaks.step_bounds() if peaks is not None else None,
            host_buffer_bytes=runtime.pool.capacity_bytes,
            host_rss_bytes=self._process.memory_info().rss,
            wall_time=wall, call_time=call_time)
        return results, stats
