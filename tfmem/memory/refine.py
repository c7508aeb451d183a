"""Refine: a re-plan that keeps the partitions of a compiled plan that still fit.

Budget mode plans a request again when it learns (a step measured over its
prediction, a step out of device memory, fragmentation), when the device holds
more than the plan was fitted beside, and for new fed shapes.  A search from
scratch slices the whole step anew, so every partition differs from the
compiled ones and each costs a new callable.  Refining keeps the compiled
plan's boundaries and splits only the partitions the corrected prediction puts
over the budget, so that the others are reused (run/compiling/reuse.py):

    compiled   [  p0  |  p1  |     p2     |  p3  ]     predicted with what was learned
    over                      ^^^^^^^^^^^^
    refined    [  p0  |  p1  | p2a  | p2b |  p3  ]     predicted again; split again where over

A split halves a partition's units by ops; boundaries are only added, so the
partition starting at the step's updates (plan/updates.py) stays.  At most
`ROUNDS` predictions, and at most `MOST_SPLIT` of the plan's partitions split:
where most go over (a learned factor scales every working set, and the search
packs partitions close to the budget), halving them all would make about twice
the Session calls of a new search's plan, and reuse little.  None then, or when
no refinement fits: the search plans from scratch.  `budget.fit` calls
`split_over_budget` with its own prediction and checks (`refine=`), so a refined
plan fits exactly as a searched one does.
"""

import logging

from tfmem.plan.build import build_plan, validate
from tfmem.plan.units import units

log = logging.getLogger(__name__)

# Predictions one refinement may take: each splits every partition over the budget once.
ROUNDS = 8
# The share of the plan's partitions a refinement may split.
MOST_SPLIT = 0.5


def split_over_budget(plan, predict, fits, over):
    """(plan, trace): `plan` with its partitions over the budget split until it fits, or
    None.  `predict(plan)` is the search's MemoryTrace of a plan, `fits(trace)` its
    verdict and `over(partition trace, peak)` whether one partition alone goes over."""
    unit_of = {op: unit for unit in units(plan.view) for op in unit}
    sliced = [tuple(dict.fromkeys(unit_of[op] for op in p.ops)) for p in plan.partitions]
    origin = list(range(len(sliced)))  # per partition of the candidate: the plan's it is of
    split = set()  # the plan's partitions split so far
    candidate = plan
    for _ in range(ROUNDS):
        trace = predict(candidate)
        if fits(trace):
            if candidate is not plan:
                validate(candidate)
                log.info("refined a plan of %d partitions into %d: only partitions "
                         "over the budget split", len(plan.partitions), len(sliced))
            return candidate, trace
        heavy = _over(trace, over)
        split.update(origin[i] for i in heavy)
        alone = any(len(sliced[i]) < 2 for i in heavy)  # a unit over the budget by itself
        if alone or len(split) > MOST_SPLIT * len(plan.partitions):
            log.info("no refinement of a plan of %d partitions: %d of them over the budget%s; "
                     "searched anew", len(plan.partitions), len(split),
                     " (one unit alone)" if alone else "")
            return None
        origin = [o for i, o in enumerate(origin) for _ in (range(2) if i in heavy else (0,))]
        sliced = [half for i, part in enumerate(sliced)
                  for half in (_halves(part) if i in heavy else (part,))]
        largest = max(sum(len(unit) for unit in part) for part in sliced)
        candidate = build_plan(plan.view, sliced, largest, plan.policy, plan.placement)
    return None


def _over(trace, over):
    """Indices of the partitions to split: those whose bytes requested alone go over or
    whose allocations the replay could not serve, else the one peaking highest (the
    plan fails as a whole: its chunks, what the device holds for others)."""
    heavy = {p.index for p in trace.partitions
             if over(p, p.device_peak_requested) or not p.served}
    return heavy or {max(trace.partitions, key=lambda p: p.device_peak).index}


def _halves(part):
    """Two runs of units of `part` with about half its ops each."""
    sizes = [len(unit) for unit in part]
    total, running = sum(sizes), 0
    for cut, size in enumerate(sizes[:-1], start=1):
        running += size
        if 2 * running >= total:
            return part[:cut], part[cut:]
    return part[:-1], part[-1:]
