"""Measure a step's device peak from TensorFlow's own figures, without resetting them.

TensorFlow's allocator peak (`get_memory_info(device)['peak']`) belongs to the
user: tfmem reads it and never resets it.  The Session front end reads each
partition's peak from its step statistics; eager TensorFlow (2.21) collects
none for function calls (`context.enable_run_metadata()` then exports no
`step_stats`, checked), so this reads the process-wide figures around each
partition call instead:

* a partition that raised the process peak reached exactly the new peak
  (allocations of other threads, such as the prefetcher's uploads, count too,
  as they do on a device);
* a partition that did not raise it reached at most the process peak, an
  unknown figure: None.

A step's peak is known when its highest partition raised the process peak,
which is then the step's peak: every other partition stayed at or below it.
So the first steps of a plan are measured, and a later step only when it goes
higher than every earlier one, which is the step worth knowing about.

For the steps in between, bounds: a partition's peak is at least the bytes in
use when it started and when it returned (its outputs still held), and at
most the process peak.  `step_bounds()` gives (lower, upper) for the step:
the most bytes seen in use at any partition's start or end, and the process
peak.  Both are TensorFlow's own figures; the truth lies between them.

`tfmem.function(options=tfmem.Options(profile_peaks=True))` measures every partition every step
instead, from the profiler's allocation events (tfmem.tf2.profiled_peaks).
"""

from tfmem.run.placement import accelerator


class PeakReader:
    """Per-partition and per-step device peaks of one step on `device`."""

    def __init__(self, device):
        self._device = device
        self._before = None
        self._step_start = None
        self.partition_peaks = []
        self.resident = None  # bytes in use when the step started: variables, inputs, the user's
        self._in_use = None  # the most bytes seen in use at a partition's start or end
        self._current = None  # bytes in use at the last reading

    def _peak(self):
        memory = accelerator.device_memory(self._device)
        if memory is None:
            return None
        self._current = memory["current"]
        self._in_use = max(self._in_use or 0, self._current)
        return memory["peak"]

    def start_step(self):
        """Record the process peak before the step; False where TensorFlow keeps none."""
        memory = accelerator.device_memory(self._device)
        self._step_start = None if memory is None else memory["peak"]
        self.resident = None if memory is None else memory["current"]
        self._in_use = self.resident
        self.partition_peaks = []
        return memory is not None

    def start_partition(self):
        self._before = self._peak()

    def end_partition(self):
        """The partition's peak if it raised the process peak, else None (unknown)."""
        after = self._peak()
        peak = after if after is not None and self._before is not None and after > self._before \
            else None
        self.partition_peaks.append(peak)
        return peak

    def finish_step(self):
        """Called once the step's partitions have run (or failed); nothing to do here."""

    def step_peak(self):
        """The step's peak when the step raised the process peak, else None (unknown)."""
        after = self._peak()
        if after is None or self._step_start is None or after <= self._step_start:
            return None
        return after

    def step_bounds(self):
        """(lower, upper) bytes around the step's peak, from figures read during the step."""
        memory = accelerator.device_memory(self._device)
        if memory is None or self._in_use is None:
            return None
        return max(self._in_use, memory["current"]), memory["peak"]
