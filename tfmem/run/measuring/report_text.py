"""The figures of a memory report, and its text: the predicted band against the measured peak.

The simulator gives two figures per partition (tfmem.memory.simulate): the
bytes its tensors and kernels request (`device_peak`), and the same
allocations replayed through TensorFlow's BFC allocator policy
(`device_peak_chunks`), a chunk often larger than its request.  TensorFlow's
measured peak usually lies between them, and where it does not, how far
outside is the prediction's error:

    requested          in chunks
        |-----band-----|
      ^ over-predicted     ^ under-predicted (measured above the band)

`band_error` is that distance relative to the measurement, signed as a
prediction error ((predicted - measured) / measured): negative when the step
measured more than both figures, 0 inside the band.  TensorFlow's own peak
for one plan varies from process to process (docs/how-it-works.md, the memory
model), so a small error either way is noise.
"""

MIB = float(1 << 20)


def trace_figures(trace):
    """The MemoryReport fields a MemoryTrace gives besides the requested-bytes peaks."""
    return dict(
        predicted_device_peak_chunks=trace.peak_device_chunks,
        predicted_partition_peaks_chunks=tuple(p.device_peak_chunks for p in trace.partitions),
        partition_scratch=tuple(p.scratch for p in trace.partitions))


def band(requested, chunks):
    """(low, high) of the two predicted figures (either may be the larger: in budget mode
    the requested figure is already the larger of both, plus an allowance)."""
    return min(requested, chunks), max(requested, chunks)


def band_error(requested, chunks, measured):
    """(edge - measured) / measured for the band's nearer edge; 0 inside the band."""
    low, high = band(requested, chunks)
    if measured > high:
        return (high - measured) / measured
    if measured < low:
        return (low - measured) / measured
    return 0.0


def describe_band_error(error):
    if error == 0:
        return "within the band"
    return (f"under-predicted by {-error:.1%} (measured above the band)" if error < 0 else
            f"over-predicted by {error:.1%} (measured below the band)")


def _mib(nbytes):
    return "-" if nbytes is None else f"{nbytes / MIB:.2f}"


def format_report(report, resident=0,
                  unknown="unknown (TensorFlow keeps no figure for this device)"):
    """A MemoryReport as text: a summary that states the band, then one row per partition.

    `resident`: bytes the device held when the step started that the prediction does
    not count (a tfmem.function's variables and inputs), added to both figures.
    `unknown`: what to say when the measured peak is None."""
    requested = report.predicted_device_peak + resident
    chunks = (report.predicted_device_peak_chunks
              if report.predicted_device_peak_chunks is not None
              else report.predicted_device_peak) + resident
    low, high = band(requested, chunks)
    if report.step:  # a TFMemSession counts its steps; a tfmem.function does not
        measured_in = ("no step of this plan was measured" if report.measured_step is None
                       else f"measured in step {report.measured_step}")
        which = f"step {report.step} ({measured_in})"
    else:
        which = "the last step"
    lines = [f"memory of {which}: predicted device peak "
             f"{_mib(requested)} MiB requested, {_mib(chunks)} MiB in BFC allocator chunks: "
             f"band {_mib(low)}-{_mib(high)} MiB"
             + (f" (with {_mib(resident)} MiB resident when the step started)" if resident
                else "")]
    if report.device_peak is not None:
        error = band_error(requested, chunks, report.device_peak)
        lines.append(f"measured device peak {_mib(report.device_peak)} MiB: "
                     f"{describe_band_error(error)}")
    else:
        lines.append(f"measured device peak: {unknown}")
    if report.device_budget is not None:
        lines.append(f"device budget {_mib(report.device_budget)} MiB (the requested figures "
                     "are budget mode's bound: the larger of the two, plus its chunk allowance)")
    lines.append(f"host: buffers {_mib(report.host_buffers)} MiB (predicted peak "
                 f"{_mib(report.predicted_host_peak)} MiB), RSS {_mib(report.host_rss)} MiB, "
                 f"available {_mib(report.host_available)} MiB")
    lines.append(f"{'part':>5} {'requested':>10} {'in chunks':>10} {'scratch':>9} "
                 f"{'measured':>10} {'band error':>10}  (MiB)")
    count = len(report.predicted_partition_peaks)
    chunk_peaks = report.predicted_partition_peaks_chunks or report.predicted_partition_peaks
    scratch = report.partition_scratch or (None,) * count
    measured = report.partition_peaks or (None,) * count
    for index in range(count):
        low_i = report.predicted_partition_peaks[index] + resident
        high_i = chunk_peaks[index] + resident
        peak = measured[index] if index < len(measured) else None
        error = "" if peak is None else f"{band_error(low_i, high_i, peak):+.1%}"
        lines.append(f"{index:>5} {_mib(low_i):>10} {_mib(high_i):>10} {_mib(scratch[index]):>9} "
                     f"{_mib(peak):>10} {error:>10}")
    return "\n".join(lines)
