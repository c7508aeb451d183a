"""Learning: budget mode's one decision after a measured step, for both front ends.

    measured step --> partition peaks - bytes the device held for others
                  --> over the plan's prediction?  no: nothing to do
                  --> yes: Correction takes in the step's kernel scratch and the
                      factor on working sets still missing; log it; plan again for
                      the NEXT step

    step out of device memory in partition i (`learn_from_out_of_memory`)
                  --> its bytes were free, in no chunk that large (fragmentation)?
                      hold that much more back; else the kernels measured again and
                      the factor raised until partition i's prediction reaches what
                      the device had for it; the error says so; plan again

The factor scales what each partition allocates while it runs, not what is
resident when it starts (`budget.scaled`).

`TFMemSession` and `tfmem.function` call `learn_from_step` after every step of
budget mode and re-plan when it returns True.  The step that went over is never
run again: it may have updated variables.  Peaks that are None (a partition
whose peak TensorFlow's figures cannot tell, see `tfmem.tf2.measure`) are left
out; the known ones still teach.
"""

import logging

from tfmem.memory.budget import scaled
from tfmem.memory.sizes import mib

log = logging.getLogger(__name__)

# How often one step that ran out of device memory before changing any state runs again
# with a new plan (each time with what its failure taught) before its error is raised.
RUNS_AGAIN = 3

# TensorFlow's figures of one plan's steps move by a few KiB from step to step (a BFC
# allocator without a cap read 8,660,224 then 8,661,248 bytes for the same MLP step): a
# step within this fraction of its corrected prediction teaches nothing, or each such
# step would plan again.  The budget's margin (budget.DEFAULT_MARGIN) covers it.
JITTER = 0.01


def learn_from_step(correction, trace, partition_peaks, resident, scratch_seen, predict,
                    what="the request", whole_device=False):
    """Compare a step's measured peaks with `trace`, the prediction its plan was fitted
    to, and correct `correction` (a `budget.Correction`) when the step went over.

    `partition_peaks`: TensorFlow's measured peak per partition (None entries, or None:
    unknown); `resident`: the device's bytes in use when the step started (or None):
    what it held beyond the request's own state (other requests' variables, other
    sessions, a function's captured variables and inputs) is in the measured peaks,
    not in the predictions, so it is taken off them; `scratch_seen`: kernel scratch
    per op the step measured, or a function returning it, called only when the step
    went over (a front end without step statistics measures it then); `predict(scratch)`:
    the plan's prediction with that scratch; `whole_device`: the budget is the whole
    device (see `budget.Correction.learn`).  True when something was learned: the
    caller plans again before the next step.
    """
    if not partition_peaks or all(m is None for m in partition_peaks):
        return False
    measured = tuple(partition_peaks)
    if resident is not None:
        foreign = max(resident - trace.state_bytes, 0)
        measured = tuple(None if m is None else m - foreign for m in measured)
    if not correction.went_over(trace, tuple(None if m is None else m / (1 + JITTER)
                                             for m in measured)):
        return False
    scratch_seen = _scratch_seen(correction, scratch_seen)
    fitted = scaled(trace, correction.factor).peak_device  # what the plan was fitted to
    if not correction.learn(trace, measured, scratch_seen, predict, whole_device):
        return False
    worst = max((i for i, m in enumerate(measured) if m is not None), key=measured.__getitem__)
    log.info("the step measured %.1f MiB (partition %d) against a predicted %.1f MiB: the "
             "model now takes the kernel scratch this step measured (%d ops) and scales "
             "what each partition allocates while it runs by %.2f; planning %s again for "
             "the next step",
             measured[worst] / (1 << 20), worst, fitted / (1 << 20),
             len(correction.scratch), correction.factor, what)
    return True


def fragmented(request, peak, limit):
    """Whether a failed allocation of `request` bytes found the bytes free but in no chunk
    that large: the allocator's peak (`peak`, TensorFlow's process-wide figure, at least
    its bytes in use when the request failed) plus the request fit its `limit`.  False
    when any figure is unknown (None)."""
    if request is None or peak is None or not limit:
        return False
    return peak + request <= limit


def learn_from_out_of_memory(correction, trace, index, capacity, resident, scratch_seen,
                             predict, what="the request", run_again=False, unchanged=False,
                             request=None, peak=None, limit=None, unsized=None):
    """A step of the plan fitted to `trace` ran out of device memory in partition `index`:
    it needed more than the device's `capacity` bytes less what the device holds for others
    (`resident`, its bytes in use after the failed step freed its own, beyond the request's
    state; None: unknown).  Correct `correction` (see `learn_from_step` for `scratch_seen`
    and `predict`) so that the next plan predicts at least that much there; returns the
    sentence the error adds.  Without it the same plan would run out again, step after step.
    `unchanged`: the step changed no state before it failed (updates.unchanged_before);
    `run_again`: so it runs again at once with the new plan, logged at INFO, since nothing
    is lost (unless it has run out RUNS_AGAIN + 1 times).

    `request`, `peak`, `limit`: the failed allocation's bytes, the allocator's peak after
    the failure and its limit (None: unknown).  When they show the bytes were free
    (`fragmented`), the lesson is to hold the request back (`learn_fragmentation`), not
    to scale every working set: the prediction's bytes were not what failed.
    `unsized`: (op, bytes) of the failed allocation where the model sized nothing that
    large for that op (a tensor of a shape only the run knows); that op is taught those
    bytes before any factor, so that one op's miss does not scale every working set."""
    if fragmented(request, peak, limit):
        correction.learn_fragmentation(request)
        message = (f"Budget mode took this in: partition {index} asked for {mib(request)} "
                   f"while the device held at most {mib(peak)} of its {mib(limit)}, so the "
                   f"bytes were free but in no chunk that large (fragmentation, which the "
                   f"model's replay of one allocation order does not show); it now holds "
                   f"back {mib(correction.held_back)} more than its margin, and {what} is "
                   f"planned again " + _then(run_again, unchanged))
        return _logged(message, run_again)
    others = max(resident - trace.state_bytes, 0) if resident is not None else 0
    available = capacity - others
    scratch_seen = _scratch_seen(correction, scratch_seen)
    corrected = correction.learn_out_of_memory(index, available, scratch_seen, predict,
                                               unsized)
    taught = (f"{unsized[0]!r} taken to allocate the {mib(unsized[1])} it asked for (the "
              f"model had not sized it), " if unsized else "")
    message = (f"Budget mode took this in: partition {index} was predicted at "
               f"{mib(trace.partitions[index].device_peak)} and needed more than the "
               f"{mib(available)} the device had for it; with {taught}its kernels measured "
               f"again and what each partition allocates while it runs scaled by "
               f"{correction.factor:.2f}, the model predicts "
               f"{mib(scaled(corrected, correction.factor).partitions[index].device_peak)} "
               f"there, and {what} is planned again " + _then(run_again, unchanged))
    return _logged(message, run_again)


def _logged(message, run_again):
    """`message`, logged at INFO where the step runs again (nothing is lost), else WARNING."""
    log.log(logging.INFO if run_again else logging.WARNING, "%s", message)
    return message


def _then(run_again, unchanged):
    """What becomes of the step that ran out (see learn_from_out_of_memory)."""
    if run_again:
        return ("and this step run again at once (it ran out before any op that changes "
                "state had run).")
    if unchanged:
        return (f"before its next step (this step ran out before changing any state, "
                f"{RUNS_AGAIN + 1} times: it is not run again).")
    return "before its next step (this step is not run again: it may have updated variables)."


def _scratch_seen(correction, scratch_seen):
    """The kernel scratch to learn from: `scratch_seen`'s figures, or, where it is a
    function measuring the request's kernels again, what it returned the first time for
    this request (a kernel configuration's figure does not change within a session, and
    measuring means importing the request into a scratch graph)."""
    if not callable(scratch_seen):
        return scratch_seen
    if correction.measured_again is None:
        correction.measured_again = scratch_seen()
    return correction.measured_again
