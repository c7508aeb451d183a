"""Budget mode tries the user's swap distance first and shorter ones (more swapped) after.

Pure: on the 12-layer MLP, near the whole step's prediction, some budgets fit only
with tensors swapped that the longer distance keeps.  The plan fitted there fits its
own prediction, and the same partitions at every longer distance do not: each
distance is predicted as the plan it makes (a distance that swaps nothing more is
the same plan, predicted once).
"""

import dataclasses

from tfmem.cli import models
from tfmem.memory import budget
from tfmem.memory.sizing import Sizing
from tfmem.plan.analyse import analyse
from tfmem.plan.build import build_plan, make_plan
from tfmem.plan.swap import SwapPolicy


def test_a_search_swaps_more_where_the_longer_distance_does_not_fit():
    model = models.mlp()
    feed = model.feed(32)
    view = analyse([model.loss], [model.train], list(model.inputs))
    sizing = Sizing.of(model.graph, view, {t.name: v.shape for t, v in feed.items()})

    def predicted(size):
        return budget.predict(make_plan(view, size, SwapPolicy(swap_distance=0)),
                              sizing).peak_device
    floor, whole = predicted(1), predicted(len(view.nodes) + 1)
    longest = SwapPolicy().swap_distance
    shorter = 0
    for share in (0.75, 0.8, 0.85, 0.9, 0.95):
        budget_bytes = int((floor + (whole - floor) * share) / (1 - budget.DEFAULT_MARGIN))
        plan, trace = budget.fit(view, sizing, budget_bytes, coarsen=False)
        assert budget.still_fits(trace, budget_bytes, trace.state_bytes)
        same_partitions = [(p.ops,) for p in plan.partitions]
        for distance in range(plan.policy.swap_distance + 1, longest + 1):
            longer = build_plan(view, same_partitions, plan.partition_size,
                                dataclasses.replace(plan.policy, swap_distance=distance),
                                plan.placement)
            assert not budget.still_fits(budget.predict(longer, sizing), budget_bytes,
                                         trace.state_bytes), (share, distance)
        shorter += plan.policy.swap_distance < longest
    assert shorter  # some budget needed more swapped than the user's distance
