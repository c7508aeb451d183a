"""The cap, derived on this machine from plain TensorFlow's measured peak, and where a
result comes from (provenance)."""

import argparse

from tfmem.cli import child_env
from tfmem.cli import provenance as tfmem_provenance

from experiments.harness.child import spawn_trial
from experiments.harness.experiment import MIB, SYSTEMS, is_tfmem
from experiments.harness.trial import describe_trial

CAP_TRIALS = 3  # plain processes whose median peak makes the cap (see derive_cap)


def derive_cap(experiment, args, out=None):
    """The cap from plain TensorFlow's measured peak at --cap-base, on this machine.

    Plain trials (oneDNN off, the BFC allocator without a cap) at `args.cap_base`,
    CAP_TRIALS of them: the peak moves by a few tenths of a MiB between processes, and
    the rounding up to a MiB would turn that into a whole MiB.  The cap is the median
    peak times `args.cap_factor`, rounded up to a MiB.  Returns a dict (base size, the
    peaks, the median, factor, cap, kernel path, the median trial), with `cap_mib` None
    and an `error` when a trial failed.
    """
    uncapped = argparse.Namespace(**vars(args))
    uncapped.device_memory = None
    measured, failed = [], None
    while len(measured) < CAP_TRIALS and failed is None:
        trial = spawn_trial(experiment, uncapped, experiment.baseline, args.cap_base,
                             args.trial_timeout)
        if trial.get("ok") and trial.get("peak_bytes"):
            measured.append(trial)
        else:
            failed = trial
    measured.sort(key=lambda t: t["peak_bytes"])
    trial = failed or measured[CAP_TRIALS // 2]
    info = dict(base_size=args.cap_base, size_name=experiment.size, factor=args.cap_factor,
                kernel_path=trial.get("kernel_path"), plain_peak_mib=None, cap_mib=None,
                plain_peaks_mib=[round(t["peak_bytes"] / MIB, 2) for t in measured],
                error=None, trial=trial)
    if failed is None:
        info["plain_peak_mib"] = round(trial["peak_bytes"] / MIB, 2)
        info["cap_mib"] = -(-int(trial["peak_bytes"] * args.cap_factor) // MIB)
    else:
        info["error"] = (f"plain TensorFlow at {experiment.size}={args.cap_base} without a cap: "
                         f"{describe_trial(dict(failed, unit=experiment.unit))}")
    if out:
        out(f"cap: plain TensorFlow's peak at {experiment.size}={args.cap_base} "
            f"({info['kernel_path']}, no cap): "
            + (f"{info['plain_peak_mib']} MiB, the median of {info['plain_peaks_mib']} -> cap "
               f"{info['cap_mib']} MiB (x{args.cap_factor:g}, rounded up)"
               if info["cap_mib"] else info["error"]))
    return info


def cap_note(experiment, args, cap_info):
    """How the cap was chosen, in one line."""
    if cap_info is None:
        return f"cap: {args.device_memory} MiB, given (--device-memory)"
    if cap_info.get("note"):
        return f"cap: {cap_info['note']}"
    return (f"cap: {cap_info['cap_mib']} MiB = plain TensorFlow's peak at {experiment.size} "
            f"{cap_info['base_size']} measured on this machine ({cap_peak_text(cap_info)}, "
            f"{cap_info['kernel_path']}, BFC allocator without a cap) x "
            f"{cap_info['factor']:g}, rounded up")


def cap_peak_text(cap_info):
    """The plain peak a cap was derived from, and the peaks it is the median of (results
    before CAP_TRIALS have one)."""
    peaks = cap_info.get("plain_peaks_mib") or []
    if len(peaks) > 1:
        return (f"{cap_info['plain_peak_mib']} MiB, the median of "
                + ", ".join(f"{p:g}" for p in peaks) + " in as many processes")
    return f"{cap_info['plain_peak_mib']} MiB"


def provenance(args, started_from=None, systems=SYSTEMS):
    """What produced a result: commit (`started_from`: the code the run started from),
    TensorFlow version, each system's kernel path, cores, date."""
    return tfmem_provenance.provenance(
        {system: child_env.kernel_path(bool(args.onednn) and is_tfmem(system))
         for system in systems}, started_from)


def provenance_note(info):
    return tfmem_provenance.describe(info)
