"""Budget mode between steps: does the request's plan still fit beside what the device
holds now?

A plan is fitted to the budget less what the device holds beyond the request's state
when it is planned (`budget.fit`).  That can grow later, and a plan that fitted may then
run out of device memory:

    plan fitted  -->  step 0  -->  device holds more  -->  check before step 1
    (resident R)      (its first     (R + copies, or        still fits?  yes: run it
                      update copies   another session's      no: log, plan again, run
                      shared buffers) tensors)                   the new plan

"Still fits" is the prediction's answer, or the plan's measured steps': what they
took above the device's bytes when they started, beside what it holds now, within the
budget less the margin.  The model is cautious (its replay serves every request with
the margin held back); a plan measured to fit is kept rather than planned again into
something smaller, or into nothing at all (the soak's one-op plan, measured at 7.7 MiB
of an 11 MiB device, was predicted at 10.9 and refused once the device held 0.3 MiB
more).

The check is one read of the allocator's current bytes before a step (never its peak),
done again only once the device holds more than at the last check: a re-plan that keeps
the plan is not repeated every step.  Both front ends use it.
"""

import logging

from tfmem.memory import budget

log = logging.getLogger(__name__)


class ResidentCheck:
    """The device's bytes a request's plan was last checked against."""

    def __init__(self):
        self.checked = 0
        self.step_bytes = None  # the most a measured step of the plan took above resident

    def record(self, stats):
        """Take in a step of the plan (its StepStats): what it took above what the device
        held when it started, when both figures are known."""
        if stats.device_peak_bytes is None or stats.resident_bytes is None:
            return
        taken = max(stats.device_peak_bytes - stats.resident_bytes, 0)
        self.step_bytes = max(taken, self.step_bytes or 0)

    def ran_out(self):
        """A step of the plan ran out of device memory: its measured steps prove nothing."""
        self.step_bytes = None

    def outgrown(self, trace, budget_bytes, resident_bytes, correction=None,
                 what="the request"):
        """True when the device now holds `resident_bytes`, more than at the last check,
        and the plan predicted `trace` no longer fits the budget beside it, by prediction
        and by its measured steps (logged)."""
        if trace is None or resident_bytes is None or resident_bytes <= self.checked:
            return False
        self.checked = resident_bytes
        if budget.still_fits(trace, budget_bytes, resident_bytes, correction=correction):
            return False
        if self.step_bytes is not None and budget.fits_by_measurement(
                self.step_bytes, budget_bytes, resident_bytes, trace.regions,
                budget.learned_margin(budget.DEFAULT_MARGIN, correction, budget_bytes,
                                      trace.regions)):
            log.info("the device holds %.1f MiB now, more than the plan of %s was fitted to; "
                     "its measured steps (%.1f MiB above what the device held) still fit: "
                     "kept", resident_bytes / (1 << 20), what, self.step_bytes / (1 << 20))
            return False
        log.info("the device holds %.1f MiB now, more than the plan of %s was fitted to; "
                 "planning it again before this step", resident_bytes / (1 << 20), what)
        return True
