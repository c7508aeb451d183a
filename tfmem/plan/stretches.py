"""Stretches: consecutive partitions that run in one Session call.

TensorFlow builds every callable from the whole session graph, so a plan's
first step costs its partitions times the graph's size (docs/how-it-works.md,
"Two front ends").  Where nothing leaves the device between partitions, a run
of them can be one callable whose partitions still run one after another:

    stretch 0 = partitions 0..31, one call
      p0's copies ...  -> stage 0 done --control--> p1's first copies ... -> stage 1 done ...
      a tensor p0 keeps for p5 is a direct edge; one p40 reads is still kept (a ticket)

Each partition's copies that read no copy of their own partition wait for
the previous partition's last ones, so TensorFlow holds what it held with
one call per partition.  A stretch ends where one call per partition does
something between two calls:

- after a partition that swaps a tensor out or returns a result (it would
  stay on the device until the call returns);
- before a partition that starts an upload or reads an uploaded copy (the
  prefetcher overlaps the upload with the partition before);
- around a partition whose originals read computed tensors (connected,
  see rewrite), kept on its own;
- before a partition whose originals touch state that an op of the stretch
  before it touches.  Your ops the plan runs as they are (originals, such
  as variable reads) cannot be made to wait: they start when the call
  starts, so one that reads a variable the stretch writes first would see
  it unwritten.

`merged(plan)` is the plan of stretches the callables run; the plan itself
stays what is predicted, measured and reported, partition by partition.
"""

import dataclasses

from tfmem.plan import optypes
from tfmem.plan.analyse import split_tensor_name
from tfmem.plan.build import Partition, Transfer, connected_inputs
from tfmem.plan.swap import Span


class _StateTouched:
    """The state sources that the stretch's ops with side effects read so far, and whether
    one of them reached state through a computed handle (`unknown`: any state)."""

    def __init__(self, view):
        self._view = view
        self.sources = set()
        self.unknown = False  # an op read state through a computed handle

    def add(self, ops):
        view = self._view
        for name in ops:
            node = view.nodes[name]
            if not node.side_effects:
                continue
            for tensor in node.inputs:
                producer = split_tensor_name(tensor)[0]
                if tensor in view.feeds:
                    continue  # a fed value, never a handle to state in a tfmem plan
                if producer in view.sources:
                    self.sources.add(producer)
                elif optypes.is_run_bound(view.tensor(tensor).dtype):
                    self.unknown = True

    def shared_with_originals(self, partition):
        """Whether an original of `partition` reads state the stretch has touched."""
        view = self._view
        read = {split_tensor_name(t)[0] for op in partition.ops if op in view.originals
                for t in view.nodes[op].inputs}
        read = {src for src in read if src in view.sources}
        return bool(read) and (self.unknown or bool(read & self.sources))


def _ends_stretch(plan, partition):
    """A partition after which the stretch must end (see the module docstring)."""
    return bool(partition.fetches) or any(plan.transfer(t).swapped for t in partition.outputs)


def _starts_stretch(plan, partition):
    """A partition that must start a stretch, whatever the stretch before it holds."""
    reads_upload = any(plan.transfer(t).span_of(partition.index).uploaded
                       for t in partition.inputs)
    return bool(partition.uploads) or reads_upload


def stretches(plan):
    """The plan's stretches: tuples of consecutive partition indices, in order."""
    view = plan.view
    result, current, touched = [], [], _StateTouched(view)
    closed = False  # the stretch so far must end here
    for p in plan.partitions:
        alone = bool(connected_inputs(view, p))
        if current and (closed or alone or _starts_stretch(plan, p)
                        or touched.shared_with_originals(p)):
            result.append(tuple(current))
            current, touched = [], _StateTouched(view)
        current.append(p.index)
        touched.add(p.ops)
        closed = alone or _ends_stretch(plan, p)
    if current:
        result.append(tuple(current))
    return tuple(result)


def _merged_transfer(transfer, stretch_of):
    """The transfer between stretches, or None when all its readers share its producer's."""
    producer = stretch_of[transfer.producer]
    spans = []
    for span in transfer.spans:
        readers = tuple(dict.fromkeys(stretch_of[r] for r in span.readers
                                      if span.uploaded or stretch_of[r] != producer))
        if readers:
            spans.append(Span(stretch_of[span.start], readers, span.uploaded))
    if not spans:
        return None
    consumers = tuple(dict.fromkeys(r for span in spans for r in span.readers))
    return Transfer(transfer.tensor, producer, consumers, tuple(spans))


def merged(plan):
    """The plan whose partitions are the stretches of `plan`, each with its `stages`
    (the partitions it runs); a plan of one stretch per partition is returned as it is."""
    groups = stretches(plan)
    if not groups or len(groups) == len(plan.partitions):
        return plan
    stretch_of = {i: s for s, group in enumerate(groups) for i in group}
    transfers = tuple(t for t in (_merged_transfer(t, stretch_of) for t in plan.transfers)
                      if t is not None)
    inputs, outputs = ([[] for _ in groups] for _ in range(2))
    for t in transfers:
        outputs[t.producer].append(t.tensor)
        for consumer in t.consumers:
            inputs[consumer].append(t.tensor)
    partitions = []
    for s, group in enumerate(groups):
        parts = [plan.partitions[i] for i in group]
        partitions.append(Partition(
            index=s,
            ops=tuple(op for p in parts for op in p.ops),
            units=sum(p.units for p in parts),
            inputs=tuple(inputs[s]),
            outputs=tuple(outputs[s]),
            feeds=tuple(dict.fromkeys(t for p in parts for t in p.feeds)),
            sources=tuple(dict.fromkeys(op for p in parts for op in p.sources)),
            fetches=tuple(t for p in parts for t in p.fetches),
            uploads=parts[0].uploads,
            stages=tuple((p.index, p.ops) for p in parts)))
    return dataclasses.replace(plan, partitions=tuple(partitions), transfers=transfers)
