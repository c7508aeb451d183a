"""Execute a plan eagerly: one ConcreteFunction call per partition.

The loop mirrors `tfmem.run.execute.Executor._run_partitions` for eager tensors:
arguments are the fed values (the function's inputs and captured handles)
and the transfers read (EagerTensors kept on the device, or uploaded again
by the prefetcher); outputs go to the shared SwapManager (kept, or copied
into a host buffer and dropped) or become the function's results.  A step
that fails releases everything it held; an out-of-memory error becomes a
`DeviceMemoryError` naming the partition and a setting predicted to fit.
"""

import time

import psutil
import tensorflow as tf

from tfmem.run import accelerator
from tfmem.memory import oom
from tfmem.run.execute import _deferred_interrupts  # pylint: disable=protected-access
from tfmem.plan.schedule import Schedule
from tfmem.run.swap_manager import SwapManager
from tfmem.run.trace import NO_TIMELINE
from tfmem.tf2.measure import PeakReader


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


class EagerExecutor:
    """Runs the PartitionFunctions of one plan of one traced graph."""

    def __init__(self, graph, plan, functions, runtime):
        self._graph = graph
        self._plan = plan
        self._functions = functions
        self._runtime = runtime  # pool, prefetcher, releaser, device, measure_device
        self._schedule = Schedule(plan)
        self._batches = {index: runtime.prefetcher.batch
                         for index, keys in enumerate(self._schedule.uploads) if keys}
        self._process = psutil.Process()
        self._fetched = frozenset(plan.view.fetches)
        self._outputs = [frozenset(p.outputs) for p in plan.partitions]
        self.last_resident = None  # device bytes in use when the last step started
        self.last_peak_bounds = None  # (lower, upper) bytes around the last step's peak

    def _run_partition(self, function, feeds, swaps, results, timeline, peaks):
        started = time.perf_counter()
        index = function.index
        swaps.start_uploads(index)
        args = [feeds[s] if s in feeds else swaps.handle_for(s, index)
                for s in function.input_sources]
        if peaks is not None:
            peaks.start_partition()
        values = function.call(*args)
        if peaks is not None:
            peaks.end_partition()
        args = None
        transfers = self._outputs[index]
        for name, value in zip(function.output_sinks, values):
            if name in transfers:
                transfer = self._plan.transfer(name)
                if transfer.kept:
                    swaps.keep(name, value)
                if transfer.swapped:
                    swaps.swap_out(name, value.numpy())
            if name in self._fetched:
                results[name] = value
        # Drop the outputs so a swapped tensor's device copy is freed now.
        values = value = None
        swaps.finish(index)
        timeline.span("partitions", f"partition {index}", started,
                      {"ops": len(self._plan.partitions[index].ops)})

    def run(self, feeds, timeline=None):
        """Run one step on {fed tensor name: EagerTensor}; return ({fetch: value}, StepStats)."""
        timeline = timeline or NO_TIMELINE
        runtime = self._runtime
        swaps = SwapManager(self._schedule, self._batches, runtime.pool, runtime.prefetcher,
                            runtime.releaser, timeline)
        peaks = PeakReader(runtime.device) if runtime.measure_device else None
        if peaks is not None and not peaks.start_step():
            peaks = None  # TensorFlow keeps no figures for this device
        self.last_resident = peaks.resident if peaks is not None else None
        started = time.perf_counter()
        results = {}
        try:
            with _deferred_interrupts() as deliver_interrupt:
                for function in self._functions:
                    try:
                        self._run_partition(function, feeds, swaps, results, timeline, peaks)
                    except tf.errors.ResourceExhaustedError as err:
                        if not oom.is_out_of_memory(err):
                            raise
                        swaps.abort()
                        shapes = {name: value for name, value in feeds.items()
                                  if value.dtype not in (tf.resource, tf.variant)}
                        devices = GraphDevices(self._graph)
                        raise oom.device_memory_error(devices, self._plan, shapes, function.index,
                                                      err, accelerator.device_capacity(devices)) from err
                    deliver_interrupt()
        except BaseException:
            swaps.abort()
            raise
        wall = time.perf_counter() - started
        self.last_peak_bounds = peaks.step_bounds() if peaks is not None else None
        stats = swaps.counts.step_stats(
            partitions=len(self._functions),
            device_peak_bytes=peaks.step_peak() if peaks is not None else None,
            partition_peak_bytes=tuple(peaks.partition_peaks) if peaks is not None else None,
            host_buffer_bytes=runtime.pool.capacity_bytes,
            host_rss_bytes=self._process.memory_info().rss,
            wall_time=wall)
        return results, stats
