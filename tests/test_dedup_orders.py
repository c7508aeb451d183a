"""The equal ops of a partition found once serve every order its ops may run in.

The simulator walks each partition in several orders (op_order.candidate_orders);
`dedup.Duplicates` merges equal ops in the first and re-keys the sets of equal ops
for the others.  Pure: on the unrolled RNN, whose two directions slice the same
input (equal ops), every order's merge through `Duplicates` is the merge
`dedup.duplicates` finds in that order alone, also where a fetched op is equal to
another (never merged away: those orders are merged again on their own).
"""

from tfmem.cli import models
from tfmem.memory import dedup, op_order
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan


def _orders_and_merges(view, signatures, size, keep_of):
    """(order, merge through Duplicates, merge alone) for every candidate order of every
    partition of the plan at `size`; `keep_of(partition)`: the tensors it keeps."""
    for partition in make_plan(view, size).partitions:
        keep = keep_of(partition)
        orders = list(op_order.candidate_orders(view, partition.ops, view.originals))
        equal = dedup.Duplicates(view, orders[0], signatures, keep)
        for index, order in enumerate(orders):
            through = equal.first if index == 0 else equal.in_order(order)
            yield order, through, dedup.duplicates(view, order, signatures, keep)


def test_equal_ops_found_once_are_merged_as_each_order_merges_them():
    model = models.unrolled_rnn(steps=6)
    view = analyse([model.loss], [model.train], list(model.inputs))
    signatures = dedup.signatures(model.graph, view)
    for size in (100000, 60):
        firsts = set()
        for order, through, alone in _orders_and_merges(
                view, signatures, size, lambda p: p.outputs + p.fetches):
            assert through == alone
            firsts.add(frozenset(alone.items()))
        assert len(firsts) > 1  # orders keep different ops of a set: the re-keying counts
    # Fetched slices, equal to the other direction's: kept apart where they come second.
    every_slice = tuple(f"{name}:0" for name, node in view.nodes.items()
                        if node.type == "StridedSlice")
    whole = make_plan(view, 100000).partitions[0].ops
    first_order = next(op_order.candidate_orders(view, whole, view.originals))
    leads = tuple(f"{op}:0" for op in set(dedup.duplicates(view, first_order,
                                                            signatures).values()))
    # the ops kept in the first order fetched: an order meeting an equal op before one
    # of them merges on its own
    for fetched in (every_slice[::2], every_slice[1::2], leads):
        fetched_changed_a_merge = False
        for order, through, alone in _orders_and_merges(view, signatures, 100000,
                                                        lambda p, f=fetched: f):
            assert through == alone
            fetched_changed_a_merge |= alone != dedup.duplicates(view, order, signatures)
        assert fetched_changed_a_merge
