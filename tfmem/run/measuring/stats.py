"""Per-step statistics: what one `run` cost in transfers, memory and time."""

import dataclasses

from tfmem.memory.sizes import MIB


@dataclasses.dataclass(frozen=True)
class StepStats:
    """Figures of the last step; byte counts are exact for swapped tensors.

    `peak_device_handle_bytes` counts the handles whose size is known (a
    static shape, or a host copy).  `device_peak_bytes` is TensorFlow's own
    allocator peak for the step, and `partition_peak_bytes` that of each
    partition, read from the step statistics of its run (TensorFlow's
    process-wide peak is left alone); None where TensorFlow reports none or
    the step was not measured (`measured`; see sampling).  A budget-mode step
    run as a partial run is measured by the process figures (run/measuring/call_peaks.py):
    its entries are None for the calls that did not raise TensorFlow's process
    peak, and `measured` says whether any, or the step's peak, is known.
    `step` counts the session's partitioned steps from 1.

    Where the time went: `call_time` is the seconds the step's thread spent inside
    the partitions' calls (TensorFlow running them); `uploads` and `upload_time`
    count the upload calls on the prefetch thread, which overlap the partitions.
    `wall_time - call_time` is tfmem's own work on the step's thread, transfers and
    prefetch waits included (tools/bench.py's per-partition overhead).
    """
    partitions: int = 0
    calls: int = 0  # Session calls that ran them (one per stretch: see plan/stretches.py)
    swapped_out: int = 0
    swapped_out_bytes: int = 0
    swapped_in: int = 0
    swapped_in_bytes: int = 0
    peak_device_handles: int = 0
    peak_device_handle_bytes: int = 0
    device_peak_bytes: int | None = None
    host_buffer_bytes: int = 0
    host_rss_bytes: int = 0
    wall_time: float = 0.0
    prefetch_wait_time: float = 0.0
    partition_peak_bytes: tuple | None = None
    call_time: float = 0.0
    uploads: int = 0
    upload_time: float = 0.0
    step: int = 0
    measured: bool = False
    # This step's own figures (concurrent steps of one plan each keep theirs): the
    # device's bytes in use when it started (None: not measured), which budget mode
    # learns from, and the kernel scratch per op its step statistics showed (the Session
    # front end only), in the allocator's chunks: budget mode's learning measures the
    # kernels again instead (run/measuring/remeasure.py).
    resident_bytes: int | None = None
    kernel_scratch: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # (lower, upper) bytes around the step's device peak, known where the peak itself is
    # not (tfmem.function, and a budget-mode partial-run step, under an earlier, higher
    # process peak; see tfmem.tf2.measure and run/measuring/call_peaks.py)
    device_peak_bounds: tuple | None = None
    # The step ran as one partial run (see run/executing/partial_run.py), not one callable per
    # partition; setup_time: starting it (counted in call_time; building its executor
    # on a request's first step)
    partial_run: bool = False
    setup_time: float = 0.0
    # Executor sets TensorFlow built for this step (each prunes and optimises the session
    # graph): a partition's first call through Session.run, or a session callable made
    # for the step's run options (see run/executing/c_path.py); build_time: the seconds of
    # those calls, running them included (in call_time), and of making those callables.
    # A partial-run step's executor: see setup_time.
    executors_built: int = 0
    build_time: float = 0.0

    def __str__(self):
        mib = MIB
        device = ("n/a" if self.measured else "not measured") if self.device_peak_bytes is None \
            else f"{self.device_peak_bytes / mib:.1f} MiB"
        return (f"{self.partitions} partitions in {self.calls} calls, "
                f"{self.wall_time * 1e3:.1f} ms "
                f"(prefetch wait {self.prefetch_wait_time * 1e3:.1f} ms); swapped out "
                f"{self.swapped_out} ({self.swapped_out_bytes / mib:.1f} MiB), in "
                f"{self.swapped_in} ({self.swapped_in_bytes / mib:.1f} MiB); device peak "
                f"{device}; handles peak {self.peak_device_handles} "
                f"({self.peak_device_handle_bytes / mib:.1f} MiB); host buffers "
                f"{self.host_buffer_bytes / mib:.1f} MiB; host RSS {self.host_rss_bytes / mib:.0f} MiB")


# StepStats' figures that the swap manager counts while a step runs.
TRANSFER_COUNTERS = ("swapped_out", "swapped_out_bytes", "swapped_in", "swapped_in_bytes",
                     "peak_device_handles", "peak_device_handle_bytes", "prefetch_wait_time",
                     "uploads", "upload_time")


class TransferCounts:
    """One step's transfer counters: StepStats' fields of those names (TRANSFER_COUNTERS),
    starting at their defaults, kept by the swap manager while the step runs."""

    def __init__(self):
        for field in dataclasses.fields(StepStats):
            if field.name in TRANSFER_COUNTERS:
                setattr(self, field.name, field.default)

    def on_device(self, handles, nbytes):
        """Raise the handle peaks to `handles` live handles holding `nbytes`."""
        self.peak_device_handles = max(self.peak_device_handles, handles)
        self.peak_device_handle_bytes = max(self.peak_device_handle_bytes, nbytes)

    def step_stats(self, **figures):
        """The step's StepStats: these counters and the executor's other `figures`."""
        return StepStats(**figures, **{name: getattr(self, name) for name in TRANSFER_COUNTERS})
