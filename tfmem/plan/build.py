"""Plan: the frozen description of how one request runs in partitions.

A plan is data, keyed by the names of the user's ops and tensors:

    Partition 0: ops (dense1, relu1)  outputs relu1:0
    Partition 1: ops (dense2, loss)   inputs relu1:0   fetches loss:0
    Transfer relu1:0: produced by 0, read by (1, 7): on the device for 0 -> 1,
                      swapped to host, uploaded during 6 for 7

`build_plan` derives it from a GraphView and its partitions; `validate`
checks the invariants every plan must hold, whoever built it.
"""

import dataclasses
import functools
import itertools

from tfmem.plan.analyse import split_tensor_name
from tfmem.errors import InvalidPlanError
from tfmem.plan.partition import partition
from tfmem.plan.place import Placement, place
from tfmem.plan.swap import SwapPolicy, spans, swappable, worth_swapping
from tfmem.plan.units import units


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A tensor produced in one partition and consumed in later ones.

    `spans` say where it waits (see `swap`): on the device as a session
    handle, or in a host buffer between spans.
    """
    tensor: str
    producer: int
    consumers: tuple
    spans: tuple  # of swap.Span, in order; together they read every consumer once

    @property
    def swapped(self):
        """True when a host copy is taken after the producer."""
        return any(span.uploaded for span in self.spans)

    @property
    def kept(self):
        """True when the producer's own device output serves a reader."""
        return not self.spans[0].uploaded

    def span_of(self, reader):
        return next(span for span in self.spans if reader in span.readers)

    def frees_at(self, reader):
        """True when `reader` is the last reader of its device copy."""
        return self.span_of(reader).readers[-1] == reader


@dataclasses.dataclass(frozen=True)
class Partition:
    """One `Session.run` of the plan."""
    index: int
    ops: tuple  # original op names, in execution order of the plan
    units: int  # how many inseparable units the ops form
    inputs: tuple  # transfer tensors consumed here
    outputs: tuple  # transfer tensors produced here
    feeds: tuple  # fed tensors consumed here
    sources: tuple  # state-source ops whose originals this partition uses
    fetches: tuple  # requested tensors produced (or, for state sources, read) here
    uploads: tuple = ()  # transfers the prefetcher uploads while this partition runs
    # Of a stretch (see stretches): (index, ops) of each partition of the plan it runs,
    # one after the other, in one call; empty for a partition of the plan itself.
    stages: tuple = ()


def connected_inputs(view, partition):
    """Computed tensors the partition's originals read: each is connected, not fed.

    An input made by another original of the same partition is a real edge
    of the user's graph, and fed tensors and sources are read where they are.
    """
    originals = [op for op in partition.ops if op in view.originals]
    tensors = []
    for name in originals:
        for tensor in view.nodes[name].inputs:
            producer = split_tensor_name(tensor)[0]
            if tensor in view.feeds or producer in view.sources or producer in originals:
                continue
            tensors.append(tensor)
    return tuple(dict.fromkeys(tensors))


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a request runs: its view, its partitions and its transfers."""
    view: object  # the GraphView the plan was built from
    partition_size: int
    partitions: tuple
    transfers: tuple
    policy: SwapPolicy = SwapPolicy()
    placement: Placement = place(None, None)

    def transfer(self, tensor):
        return self._transfer_of[tensor]

    @functools.cached_property
    def _transfer_of(self):
        return {t.tensor: t for t in self.transfers}

    @property
    def num_ops(self):
        return sum(len(p.ops) for p in self.partitions)

    def __str__(self):
        swapped = sum(t.swapped for t in self.transfers)
        lines = [f"Plan: {self.num_ops} ops in {len(self.partitions)} partitions "
                 f"(partition_size={self.partition_size}), {len(self.transfers)} transfers, "
                 f"{swapped} swapped (swap={self.policy.mode!r}, "
                 f"swap_distance={self.policy.swap_distance}, prefetch={self.policy.prefetch})",
                 str(self.placement)]
        lines.append(f"{'part':>5} {'ops':>6} {'in':>5} {'out':>5} {'fetch':>6}")
        for p in self.partitions:
            lines.append(f"{p.index:>5} {len(p.ops):>6} {len(p.inputs):>5} "
                         f"{len(p.outputs):>5} {len(p.fetches):>6}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Slicing:
    """What a plan of given partitions is whatever its swap policy: its partitions' ops
    and edges, and the tensors that cross from one partition to later ones.  A budget
    search predicts one slicing under several swap distances."""
    partitions: tuple  # ops per partition
    units: tuple  # units per partition
    crossings: tuple  # (tensor, producer, later readers, whether it may be swapped)
    feeds: tuple  # fed tensors per partition
    sources: tuple  # state sources per partition
    fetches: tuple  # fetched tensors per partition

    @classmethod
    def of(cls, view, partitioned_units):
        """The slicing of `view` into `partitioned_units` (tuples of units of op names)."""
        partitions = [tuple(itertools.chain.from_iterable(units)) for units in partitioned_units]
        partition_of = {op: i for i, ops in enumerate(partitions) for op in ops}
        crossings = []
        for tensor, op_name, readers, reads_state in view.computed_reads:
            producer = partition_of.get(op_name)
            if producer is None:
                continue
            if len(readers) == 1 and partition_of[readers[0]] == producer:
                continue  # most tensors: one reader, in the producer's partition
            later = {partition_of[name] for name in readers}
            later.discard(producer)
            if later:
                crossings.append((tensor, producer, tuple(sorted(later)), not reads_state))
        crossings.sort(key=lambda c: (c[1], c[0]))

        fetch_home = {}
        last = max(len(partitions) - 1, 0)
        for tensor in view.fetches:
            fetch_home[tensor] = partition_of.get(split_tensor_name(tensor)[0], last)
        if not partitions and fetch_home:
            partitions = [()]  # only state sources are fetched: one run reads them
        fetches = [[] for _ in partitions]
        for tensor, home in fetch_home.items():
            fetches[home].append(tensor)
        feeds, sources = [], []
        data_reads, control_reads = view.outside_reads
        for i, ops in enumerate(partitions):
            used = [pair for name in ops if name in data_reads for pair in data_reads[name]]
            if control_reads:  # an original waiting for a fed placeholder runs it: feed it
                used += [pair for name in ops for pair in control_reads.get(name, ())]
            fetched_sources = [split_tensor_name(t)[0] for t in fetches[i]
                               if split_tensor_name(t)[0] in view.sources]
            feeds.append(tuple(dict.fromkeys(t for t, _ in used if t in view.feeds)))
            sources.append(tuple(dict.fromkeys(
                [op for _, op in used if op in view.sources] + fetched_sources)))
        return cls(tuple(partitions),
                   tuple(len(units) for units in partitioned_units) if partitioned_units
                   else tuple(0 for _ in partitions),
                   tuple(crossings), tuple(feeds), tuple(sources),
                   tuple(tuple(f) for f in fetches))


def build_plan(view, partitioned_units, partition_size, policy=SwapPolicy(), placement=None,
               slicing=None):
    """The Plan that runs the partitions (tuples of units of op names) in order.
    `slicing`: `Slicing.of(view, partitioned_units)`, when the caller has it."""
    slicing = slicing or Slicing.of(view, partitioned_units)
    transfers = []
    for tensor, producer, later, may_swap in slicing.crossings:
        can_swap = may_swap and worth_swapping(view.tensor(tensor), policy)
        transfers.append(Transfer(tensor, producer, later,
                                  spans(producer, later, policy, can_swap)))

    partitions = slicing.partitions
    inputs, outputs, uploads = ([[] for _ in partitions] for _ in range(3))
    for t in transfers:
        outputs[t.producer].append(t.tensor)
        for consumer in t.consumers:
            inputs[consumer].append(t.tensor)
        for span in t.spans:
            if span.uploaded:
                uploads[span.start].append(t.tensor)
    built = [Partition(index=i, ops=ops, units=slicing.units[i], inputs=tuple(inputs[i]),
                       outputs=tuple(outputs[i]), feeds=slicing.feeds[i],
                       sources=slicing.sources[i], fetches=slicing.fetches[i],
                       uploads=tuple(dict.fromkeys(uploads[i])))
             for i, ops in enumerate(partitions)]
    return Plan(view=view, partition_size=partition_size, partitions=tuple(built),
                transfers=tuple(transfers), policy=policy,
                placement=placement or place(view, None))


def _span_problems(t):
    """Spans read every consumer once, in order; uploads follow the producer."""
    problems = []
    readers = [r for span in t.spans for r in span.readers]
    if readers != list(t.consumers):
        problems.append(f"transfer '{t.tensor}' spans read {readers}, not its consumers "
                        f"{list(t.consumers)}")
    for position, span in enumerate(t.spans):
        if position and not span.uploaded:
            problems.append(f"transfer '{t.tensor}' reads the producer's device copy after "
                            "an earlier span freed it")
        if not span.readers:
            problems.append(f"transfer '{t.tensor}' has a span with no reader")
        elif span.uploaded and not t.producer < span.start <= span.readers[0]:
            problems.append(f"transfer '{t.tensor}' is uploaded during partition {span.start}, "
                            f"outside ({t.producer}, {span.readers[0]}]")
        elif not span.uploaded and span.start != t.producer:
            problems.append(f"transfer '{t.tensor}' keeps a device copy it did not produce")
    return problems


def _oversized(plan):
    """Partitions over partition_size that hold more than one unit."""
    return [f"partition {p.index} has {len(p.ops)} ops in {p.units} units, over "
            f"partition_size={plan.partition_size}" for p in plan.partitions
            if len(p.ops) > plan.partition_size and p.units > 1]


def _partition_problems(plan, home):
    """Every copied op in exactly one partition, state sources in none, sizes kept."""
    view = plan.view
    placed = {op: p.index for p in plan.partitions for op in p.ops}
    if len(placed) == sum(len(p.ops) for p in plan.partitions) and \
            placed.keys() == view.nodes.keys() and placed.keys().isdisjoint(view.sources):
        home.update(placed)  # every op once and none a source, told by set operations
        return _oversized(plan)
    problems = []
    for p in plan.partitions:
        for op in p.ops:
            if op in home:
                problems.append(f"op '{op}' is in partitions {home[op]} and {p.index}")
            home[op] = p.index
            if op in view.sources:
                problems.append(f"state source '{op}' is copied into partition {p.index}")
    problems += _oversized(plan)
    problems += [f"op '{op}' is in no partition" for op in view.nodes if op not in home]
    problems += [f"unknown op '{op}' in partition {home[op]}"
                 for op in home if op not in view.nodes]
    return problems


def _original_problems(plan, home):
    """Originals are ops of the request whose control inputs run once, in the same call.

    Running the user's op runs the ops its control edges reach: each must be
    a state source (idempotent), a fed placeholder, or an original of the
    same partition (run there anyway, once).  Anything else would run again.
    """
    view, problems = plan.view, []
    for name in sorted(view.originals):
        node = view.nodes.get(name)
        if node is None:
            problems.append(f"original '{name}' is not an op of the request")
            continue
        again = [src for src in node.control_inputs
                 if src not in view.sources and src + ":0" not in view.feeds
                 and not (src in view.originals and home.get(src) == home.get(name))]
        if again:
            problems.append(f"original '{name}' has control inputs {again}; "
                            "running the user's op would run them again")
    return problems


def _edge_problems(plan, home):
    """Producers run before consumers; a tensor read later crosses as a transfer."""
    view, problems = plan.view, []
    transfers = {t.tensor: t for t in plan.transfers}
    for tensor, producer_op, readers, _ in view.computed_reads:  # the data edges, by tensor
        producer = home.get(producer_op)
        if producer is None:
            continue
        for reader in readers:
            consumer = home.get(reader)
            if consumer is None or consumer == producer:
                continue
            transfer = transfers.get(tensor)
            if producer > consumer:
                problems.append(f"'{reader}' (partition {consumer}) reads '{tensor}' "
                                f"produced later, in partition {producer}")
            elif transfer is None or consumer not in transfer.consumers:
                problems.append(f"'{tensor}' crosses from partition {producer} to "
                                f"{consumer} without a transfer")
    for node in view.nodes.values():
        if not node.control_inputs:
            continue
        consumer = home.get(node.name)
        for src in node.control_inputs:
            producer = home.get(src)
            if producer is not None and consumer is not None and producer > consumer:
                problems.append(f"control edge '{src}' -> '{node.name}' runs backwards "
                                f"(partition {producer} -> {consumer})")
    return problems


def _transfer_problems(plan, home):
    """Transfers cross runs (dtype), name their producer, are read later, span rightly."""
    view, problems = plan.view, []
    for t in plan.transfers:
        info = view.tensor(t.tensor)
        if info.run_bound:
            problems.append(f"transfer '{t.tensor}' has dtype {info.dtype.name}, "
                            "which does not survive a Session.run")
        if home.get(split_tensor_name(t.tensor)[0]) != t.producer:
            problems.append(f"transfer '{t.tensor}' names the wrong producer")
        if not t.consumers or min(t.consumers) <= t.producer:
            problems.append(f"transfer '{t.tensor}' is not consumed after it is produced")
        problems += _span_problems(t)
        if t.swapped and not swappable(info.dtype):
            problems.append(f"transfer '{t.tensor}' of dtype {info.dtype.name} cannot be swapped")
    return problems


def _fetch_problems(plan):
    """Every fetch is produced by exactly one partition."""
    fetched = [t for p in plan.partitions for t in p.fetches]
    return [f"fetch '{tensor}' is produced by {fetched.count(tensor)} partitions"
            for tensor in plan.view.fetches if fetched.count(tensor) != 1]


def _source_problems(plan):
    """State sources have no inputs to re-run; the placement copies only constants."""
    view, problems = plan.view, []
    for name, node in view.sources.items():
        if node.inputs or node.control_inputs:
            problems.append(f"state source '{name}' has inputs and would re-run them")
    for name in plan.placement.copied:
        if name not in view.sources or view.sources[name].type != "Const":
            problems.append(f"placement copies '{name}', which is not a constant of the request")
    return problems


def validate(plan):
    """Check the plan's invariants; raise InvalidPlanError listing every breach.

    Every copied op is in exactly one partition and state sources in none;
    producers run before consumers; every tensor read in a later partition
    is a transfer of a dtype that may cross runs; partitions respect
    partition_size unless they hold a single unit; every fetch has a home.
    Stateful ops therefore run once per step; state sources, which may be
    read by several partitions, are idempotent by construction (`optypes`).
    Originals (the user's own ops, see `analyse`) are ops of the request whose
    control inputs are sources, fed, or originals of the same partition: a
    partition running the user's op runs those inputs too, and anything else
    would run again.  One checker per invariant, below.
    """
    home = {}  # op name -> its partition, filled by the first checker
    problems = _partition_problems(plan, home)
    problems += _original_problems(plan, home)
    problems += _edge_problems(plan, home)
    problems += _transfer_problems(plan, home)
    problems += _fetch_problems(plan)
    problems += _source_problems(plan)
    if problems:
        raise InvalidPlanError("invalid plan:\n  " + "\n  ".join(problems))


def make_plan(view, partition_size, policy=SwapPolicy(), accelerator=None):
    """Place, group, partition and plan one analysed request (`analyse`'s GraphView);
    the result is validated.

    `accelerator` is the session's accelerator when state should go to the host.
    """
    plan = build_plan(view, partition(view, units(view), partition_size), partition_size,
                      policy, place(view, accelerator, policy.min_bytes))
    validate(plan)
    return plan
