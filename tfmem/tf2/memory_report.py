"""memory_report() of a tfmem.function: TFMemSession's report, plus what was resident.

The TF2 simulator counts the step's own tensors only: the captured variables
and the inputs are memory the device already holds when a step starts (see
docs/api.md, `tfmem.function`).  TensorFlow's peak counts them, so the
report adds the bytes in use when the step started (`device_resident`): the
measured peak compares with `device_resident + predicted_device_peak`.
"""

import dataclasses

from tfmem.run.measuring import report_text
from tfmem.run.measuring.memory_report import MemoryReport, predicted_fields


@dataclasses.dataclass(frozen=True)
class FunctionMemoryReport(MemoryReport):
    """Device and host memory of the last step of a tfmem.function (bytes).

    `device_peak` and `partition_peaks` are TensorFlow's allocator figures read
    without resetting them (tfmem.tf2.measure): None where a step or partition
    did not raise the process peak, so its own peak is unknown.
    """
    device_resident: int | None = None  # allocator bytes in use when the step started
    # (lower, upper) bytes the step's peak lies between, known also when `device_peak` is
    # None: the most bytes in use at a partition's start or end, and the process peak.
    device_peak_bounds: tuple | None = None

    def __str__(self):
        text = report_text.format_report(
            self, resident=self.device_resident or 0,
            unknown="unknown (this step did not raise TensorFlow's process peak, or the "
                    "device keeps no figures)")
        if self.device_peak is None and self.device_peak_bounds is not None:
            low, high = self.device_peak_bounds
            text += (f"\nthe step's device peak lies between {low / (1 << 20):.2f} and "
                     f"{high / (1 << 20):.2f} MiB (device_peak_bounds)")
        return text


def function_memory_report(step, trace, budget_bytes):
    """The FunctionMemoryReport of StepStats `step`, run by a plan predicted as `trace`."""
    return FunctionMemoryReport(
        device_peak=step.device_peak_bytes,
        partition_peaks=step.partition_peak_bytes,
        device_resident=step.resident_bytes,
        device_peak_bounds=step.device_peak_bounds,
        **predicted_fields(step, trace, budget_bytes))
