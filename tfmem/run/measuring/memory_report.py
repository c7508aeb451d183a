"""MemoryReport: what a TFMemSession's last step used, measured and predicted.

A step's measured figures are TensorFlow's allocator peaks, read on the steps
sampling measures; its predicted figures are the simulator's for the plan
that ran it, scaled by what budget mode had learned when the plan was fitted.
"""

import dataclasses

import psutil

from tfmem.memory import budget
from tfmem.run.measuring import report_text


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Device and host memory of the last step, measured and predicted (bytes)."""
    device_peak: int | None  # TensorFlow's allocator peak; None where it keeps none
    predicted_device_peak: int  # the simulator's prediction for the plan
    device_budget: int | None
    host_buffers: int  # host bytes tfmem holds for swapped tensors
    predicted_host_peak: int
    host_rss: int
    host_available: int
    # Per partition, kernel scratch included: the simulator's peaks, and TensorFlow's
    # measured ones (None where it keeps no figures).
    predicted_partition_peaks: tuple = ()
    partition_peaks: tuple | None = None
    # The last step, and the step whose measured figures (device_peak, partition_peaks)
    # these are: the plan's last measured one (None: none measured; see sampling).
    step: int = 0
    measured_step: int | None = None
    # The same predictions in BFC allocator chunks (simulate's device_peak_chunks), and
    # each partition's largest kernel scratch (counted in its peaks): the measured peak
    # usually lies in the band between the requested and the chunk figures.
    predicted_device_peak_chunks: int | None = None
    predicted_partition_peaks_chunks: tuple = ()
    partition_scratch: tuple = ()

    def __str__(self):
        return report_text.format_report(self)



def predicted_fields(step, trace, budget_bytes):
    """The MemoryReport fields both front ends fill alike: the prediction `trace` of the
    plan that ran StepStats `step`, the budget, and the host's figures."""
    return dict(
        predicted_device_peak=trace.peak_device,
        device_budget=budget_bytes,
        host_buffers=step.host_buffer_bytes,
        predicted_host_peak=trace.peak_host,
        host_rss=step.host_rss_bytes,
        host_available=psutil.virtual_memory().available,
        predicted_partition_peaks=tuple(p.device_peak for p in trace.partitions),
        **report_text.trace_figures(trace))


def session_report(last_step, entry, factor, budget_bytes):
    """The MemoryReport of StepStats `last_step`, run by the cached `entry` whose plan was
    fitted with the learned `factor`, under `budget_bytes` (or None)."""
    measured = entry.last_measured
    return MemoryReport(
        device_peak=measured.device_peak_bytes if measured else None,
        partition_peaks=measured.partition_peak_bytes if measured else None,
        step=last_step.step, measured_step=measured.step if measured else None,
        **predicted_fields(last_step, budget.scaled(entry.trace, factor), budget_bytes))
