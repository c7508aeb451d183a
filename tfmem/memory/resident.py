"""Budget mode between steps: does the request's plan still fit beside what the device
holds now?

A plan is fitted to the budget less what the device holds beyond the request's state
when it is planned (`budget.fit`).  That can grow later, and a plan that fitted may then
run out of device memory:

    plan fitted  -->  step 0  -->  device holds more  -->  check before step 1
    (resident R)      (its first     (R + copies, or        still fits?  yes: run it
                      update copies   another session's      no: log, plan again, run
                      shared buffers) tensors)                   the new plan

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

    def outgrown(self, trace, budget_bytes, resident_bytes, correction=None,
                 what="the request"):
        """True when the device now holds `resident_bytes`, more than at the last check,
        and the plan predicted `trace` no longer fits the budget beside it (logged)."""
        if trace is None or resident_bytes is None or resident_bytes <= self.checked:
            return False
        self.checked = resident_bytes
        if budget.still_fits(trace, budget_bytes, resident_bytes, correction=correction):
            return False
        log.info("the device holds %.1f MiB now, more than the plan of %s was fitted to; "
                 "planning it again before this step", resident_bytes / (1 << 20), what)
        return True
