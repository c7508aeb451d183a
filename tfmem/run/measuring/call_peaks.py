"""Call peaks: a partial-run step's device peaks from TensorFlow's process figures.

A partial run takes no RunOptions and returns no RunMetadata, so it has no
step statistics to read a partition's peak from (execute.measured_peak).
What is left is the allocator's process-wide figures, read around each
partition's call and never reset (the peak is the user's):

    peak before call k   p0          bytes in use before   c0
    peak after call k    p1          bytes in use after    c1

* p1 > p0: the call raised the process peak, so its own peak is exactly p1
  (allocations of other threads, such as the prefetcher's uploads, count too,
  as they would on a device);
* p1 == p0: its peak was at most p0, an unknown figure: None, with the bounds
  (max(c0, c1), p0): it held at least what was in use when it started and
  returned, at most the process peak.

The step's peak is known when the process peak rose during the step (in a
call, or between calls: the prefetcher's uploads): it is then the process
peak after the step, every other moment of the step stayed at or below it.
So on a fresh process the first step of a plan is measured whole, and a later
step only in the calls that go higher than anything before: those are the
calls that matter to budget mode, which learns from steps that went over.
Steps of other threads running meanwhile count in the figures as well.
"""

from tfmem.run.placement import accelerator


class CallPeaks:
    """Per-call device peaks of one step on `device`, from the process figures."""

    def __init__(self, device):
        self._device = device
        self._before = None  # the process peak before the current call
        self._in_use = 0  # bytes in use before the current call
        self.partition_peaks = []  # per call: its peak, or None when it raised nothing
        self.partition_bounds = []  # per call: (lower, upper) bytes its peak lies between
        self.resident = None  # bytes in use when the step started
        self.step_start_peak = None

    def start_step(self):
        """Read the figures before the step; False where TensorFlow keeps none."""
        memory = accelerator.device_memory(self._device)
        if memory is None:
            return False
        self.resident = memory["current"]
        self.step_start_peak = memory["peak"]
        return True

    def start_call(self):
        memory = accelerator.device_memory(self._device)
        self._before, self._in_use = memory["peak"], memory["current"]

    def end_call(self):
        """Record the call's peak (None: it did not raise the process peak) and bounds."""
        memory = accelerator.device_memory(self._device)
        after = memory["peak"]
        lower = max(self._in_use, memory["current"])
        if after > self._before:
            self.partition_peaks.append(after)
            self.partition_bounds.append((after, after))
        else:
            self.partition_peaks.append(None)
            self.partition_bounds.append((lower, self._before))

    def step_peak(self):
        """The step's peak when the process peak rose during the step, else None."""
        memory = accelerator.device_memory(self._device)
        return memory["peak"] if memory["peak"] > self.step_start_peak else None

    def step_bounds(self):
        """(lower, upper) bytes around the step's peak: the most any call is known to have
        held, and the process peak now."""
        if not self.partition_bounds:
            return None
        peak = accelerator.device_memory(self._device)["peak"]
        return max(low for low, _ in self.partition_bounds), peak
