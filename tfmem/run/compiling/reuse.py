"""Reuse: the compiled partitions a new plan of a request takes from plans before it.

A re-plan (budget mode learning from a step, a new fed shape) often keeps most
partitions of the plan it replaces, and a compiled partition's copies and
callable do only what the partition says.  Two partitions of plans of one
analysis of a request (equal views) are interchangeable when they agree on

    stages      the ops of each partition a call runs, in order (a stretch
                runs several; see plan/stretches.py)
    inputs      each transfer read, and whether this call deletes its device copy
    feeds       the request's fed tensors read
    outputs     each transfer made, and how it leaves: kept by session handle,
                fetched to a host buffer (swapped), or both
    fetches     the requested tensors made here
    host copies the constants the plan reads from host copies, and where

which is everything `plan_import` writes for a partition (its connected
inputs and chains follow from its ops and the view).  The partition's index is
not part of it: a compiled partition keeps the name scope it was imported
under (`Program.scope`), and the swap manager addresses transfers by name.

Only the session-handle residence is reused (its ops hold no per-plan state);
staging on a distributed session and partial runs compile every plan whole.
"""


def partition_key(plan, partition):
    """What a compiled copy of `partition` (of `plan`, or of its stretches) does."""
    inputs = tuple((name, plan.transfer(name).frees_at(partition.index))
                   for name in partition.inputs)
    outputs = tuple((name, plan.transfer(name).kept, plan.transfer(name).swapped)
                    for name in partition.outputs)
    stages = tuple(ops for _, ops in partition.stages) or (partition.ops,)
    return (stages, inputs, tuple(partition.feeds), outputs, tuple(partition.fetches),
            tuple(sorted(plan.placement.copied.items())))


class Compiled:
    """The programs of one compiled plan by partition key, and their callables."""

    def __init__(self, run_plan, programs):
        self.view = run_plan.view
        self.programs = {partition_key(run_plan, p): program
                         for p, program in zip(run_plan.partitions, programs)}


def reusable(run_plan, donors):
    """{partition index: Program} of `run_plan`'s partitions compiled already by one of
    `donors` (`Compiled` of plans of the same request)."""
    found = {}
    for donor in donors:
        if donor.view is not run_plan.view and donor.view != run_plan.view:
            continue
        for p in run_plan.partitions:
            if p.index not in found:
                program = donor.programs.get(partition_key(run_plan, p))
                if program is not None:
                    found[p.index] = program
    return found
