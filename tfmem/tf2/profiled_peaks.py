"""Each partition's own device peak, every step, from TensorFlow's profiler (opt-in).

`tfmem.tf2.measure.PeakReader` reads the process-wide peak around each
partition call and may not reset it (the figure is the user's), so a
partition that stays under an earlier, higher peak gets None.  TensorFlow's
allocators say more to a profiler: each allocation emits a `MemoryAllocation`
event carrying `bytes_allocated`, the allocator's bytes in use right after it
(the very figure its peak is the maximum of).  So a partition's peak is the
most of: the bytes in use when it started, and every `bytes_allocated` of an
allocation made while it ran (by any thread: the prefetcher's uploads count,
as they do for the process peak).

One profiler session spans a step; a TraceMe marker around each partition
call gives the windows the events are sorted into (the exported profile's
times are relative to the session's start, so Python's clock cannot be used).
Nothing the user sees from TensorFlow changes: the peak is not reset, no run
metadata is touched.  TensorFlow runs one profiler session at a time: while
the user's (or a profiler server's) is active, this one cannot start, and the
step falls back to PeakReader's figures; while this one runs (during a step),
a profiler started from another thread is refused by TensorFlow.

The profile reaches Python only as the file `export_to_tb` writes
(`ProfilerSession.stop()` returns bytes without the memory events in 2.21),
so each step writes and reads one small file in a temporary directory.
Cost: tens to hundreds of milliseconds per step, measured by
`tools/bench_peaks_tf2.py`.
"""

import glob
import logging
import os
import shutil
import tempfile

from tfmem import tf_private
from tfmem.tf2.measure import PeakReader

log = logging.getLogger(__name__)

_MARK = "tfmem_partition_peak_"


def _allocator_matches(device, name):
    """Whether allocator `name` serves `device` ('/device:GPU:0', 'CPU:0', ...)."""
    kind, _, number = device.rsplit("/", 1)[-1].replace("device:", "").partition(":")
    if kind.upper() == "GPU":
        return name == f"GPU_{number or 0}_bfc"
    return not name.startswith(("GPU_", "gpu_host"))


class ProfiledPeaks(PeakReader):
    """PeakReader whose partition peaks come from the profiler's allocation events."""

    def __init__(self, device):
        super().__init__(device)
        self._session = None
        self._directory = None
        self._starts = []  # bytes in use when each partition started
        self._marks = []
        self.profiled = False  # whether the last step's peaks came from the profiler

    def start_step(self):
        if not super().start_step():
            return False
        self._starts, self._marks = [], []
        self._directory = tempfile.mkdtemp(prefix="tfmem-peaks-")
        self._session = tf_private.start_profiler(self._directory)
        if self._session is None:
            shutil.rmtree(self._directory, ignore_errors=True)
            log.debug("a profiler session is active already: this step's partition peaks "
                      "come from the process peak")
        return True

    def start_partition(self):
        super().start_partition()
        if self._session is not None:
            self._starts.append(self._current)
            mark = tf_private.trace_marker(f"{_MARK}{len(self._marks)}")
            self._marks.append(mark)
            mark.__enter__()

    def end_partition(self):
        if self._session is not None:
            self._marks[-1].__exit__(None, None, None)
        return super().end_partition()

    def finish_step(self):
        """Stop the profiler and replace the partition peaks by the profile's figures."""
        session, self._session = self._session, None
        self.profiled = False
        if session is None:
            return
        try:
            session.export_to_tb()
            files = glob.glob(os.path.join(self._directory, "**", "*.xplane.pb"), recursive=True)
            if not files:
                return
            with open(files[0], "rb") as handle:
                events = tf_private.profile_memory_events(handle.read())
        except Exception as error:  # pylint: disable=broad-except
            # Called also while a failed step unwinds: never hide the step's own error.
            log.warning("the profile of this step could not be read (%s): its partition "
                        "peaks come from the process peak", error)
            return
        finally:
            shutil.rmtree(self._directory, ignore_errors=True)
        self._apply(events)

    def _apply(self, events):
        windows = {}  # partition index -> (start, end) in the profile's time
        allocations = []  # (time, bytes in use after)
        for name, start, end, stats in events:
            if name.startswith(_MARK):
                windows[int(name[len(_MARK):])] = (start, end)
            elif name == "MemoryAllocation" and _allocator_matches(
                    self._device, stats.get("allocator_name", "")):
                allocations.append((start, stats["bytes_allocated"]))
        if len(windows) != len(self.partition_peaks):
            return  # markers lost (another profiler client?): keep the process figures
        peaks = []
        for index, before in enumerate(self._starts):
            start, end = windows[index]
            inside = [in_use for when, in_use in allocations if start <= when <= end]
            peaks.append(max([before or 0] + inside))
        self.partition_peaks = peaks
        self.profiled = True

    def step_peak(self):
        if self.profiled and self.partition_peaks:
            return max(max(self.partition_peaks), super().step_peak() or 0)
        return super().step_peak()
