"""Schedule: what every step of a plan does with its transfers, worked out once.

Derived from the plan alone (which device copies each partition reads, frees
and uploads), so both the runtime's swap manager and the memory simulator
replay the same schedule; it lives in the plan wing so the simulator need not
import the runtime.
"""

import functools


class Schedule:
    """What every step of a plan does with its transfers, worked out once.

    A device copy is keyed by (tensor, first reader of its span).
    """

    def __init__(self, plan):
        self.plan = plan
        self.reads = []  # per partition: {tensor: key} of the copies it feeds
        self.frees = []  # per partition: keys its deleters free in-graph
        self.uploads = []  # per partition: keys uploaded while it runs, in batch order
        for p in plan.partitions:
            reads, frees = {}, []
            for tensor in p.inputs:
                span = plan.transfer(tensor).span_of(p.index)
                key = reads[tensor] = (tensor, span.readers[0])
                if span.readers[-1] == p.index:  # Transfer.frees_at
                    frees.append(key)
            self.reads.append(reads)
            self.frees.append(frees)
            self.uploads.append([(t, span.readers[0]) for t in dict.fromkeys(p.uploads)
                                 for span in plan.transfer(t).spans
                                 if span.uploaded and span.start == p.index])
        self.kept = {t.tensor: (t.tensor, t.spans[0].readers[0]) for t in plan.transfers if t.kept}
        self.upload_count = {t.tensor: sum(s.uploaded for s in t.spans) for t in plan.transfers}

    @functools.cached_property
    def nbytes(self):
        """{transferred tensor: its static bytes (0 when not known)}: what the swap manager
        moves.  Found when first read: the simulator, which makes a schedule for every
        candidate plan of a budget search, sizes tensors its own way."""
        return {t.tensor: self.plan.view.tensor(t.tensor).nbytes or 0
                for t in self.plan.transfers}
