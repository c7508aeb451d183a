"""Plan: the frozen description of how one request runs in partitions.

A plan is data, keyed by the names of the user's ops and tensors:

    Partition 0: ops (dense1, relu1)  outputs relu1:0
    Partition 1: ops (dense2, loss)   inputs relu1:0   fetches loss:0
    Transfer relu1:0: produced by 0, consumed by (1,), kept on the device

`build_plan` derives it from a GraphView and its partitions; `validate`
checks the invariants every plan must hold, whoever built it.
"""

import dataclasses
import enum

from tfmem.analyse import analyse, split_tensor_name
from tfmem.errors import InvalidPlanError
from tfmem.partition import partition
from tfmem.units import units


class Residency(enum.Enum):
    """Where a transfer waits between its producer and its consumers."""
    DEVICE = "device"  # a session handle: the tensor stays in device memory
    HOST = "host"  # a numpy array in host memory, fed back to the consumer


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A tensor produced in one partition and consumed in later ones."""
    tensor: str
    producer: int
    consumers: tuple
    residency: Residency

    @property
    def last_consumer(self):
        return self.consumers[-1]


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


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a request runs: its view, its partitions and its transfers."""
    view: object  # the GraphView the plan was built from
    partition_size: int
    partitions: tuple
    transfers: tuple

    def transfer(self, tensor):
        return next(t for t in self.transfers if t.tensor == tensor)

    @property
    def num_ops(self):
        return sum(len(p.ops) for p in self.partitions)

    def __str__(self):
        lines = [f"Plan: {self.num_ops} ops in {len(self.partitions)} partitions "
                 f"(partition_size={self.partition_size}), {len(self.transfers)} transfers"]
        lines.append(f"{'part':>5} {'ops':>6} {'in':>5} {'out':>5} {'fetch':>6}")
        for p in self.partitions:
            lines.append(f"{p.index:>5} {len(p.ops):>6} {len(p.inputs):>5} "
                         f"{len(p.outputs):>5} {len(p.fetches):>6}")
        return "\n".join(lines)


def _consumers(view, partition_of):
    """tensor name -> sorted partitions of the copied ops that read it."""
    readers = {}
    for node in view.nodes.values():
        for tensor in node.inputs:
            readers.setdefault(tensor, set()).add(partition_of[node.name])
    return {t: tuple(sorted(p)) for t, p in readers.items()}


def build_plan(view, partitioned_units, partition_size,
               residency=lambda tensor: Residency.DEVICE):
    """The Plan that runs the partitions (tuples of units of op names) in order."""
    partitions = [tuple(op for unit in units for op in unit) for units in partitioned_units]
    partition_of = {op: i for i, ops in enumerate(partitions) for op in ops}
    readers = _consumers(view, partition_of)
    transfers = []
    for tensor, parts in readers.items():
        if tensor in view.feeds:
            continue  # fed: every reader gets the fed value
        op_name, _ = split_tensor_name(tensor)
        producer = partition_of.get(op_name)
        later = tuple(p for p in parts if p != producer)
        if producer is not None and later:
            transfers.append(Transfer(tensor, producer, later, residency(tensor)))
    transfers.sort(key=lambda t: (t.producer, t.tensor))

    fetch_home = {}
    last = max(len(partitions) - 1, 0)
    for tensor in view.fetches:
        op_name, _ = split_tensor_name(tensor)
        fetch_home[tensor] = partition_of.get(op_name, last)
    if not partitions and fetch_home:
        partitions = [()]  # only state sources are fetched: one run reads them

    built = []
    for i, ops in enumerate(partitions):
        used_inputs = [t for name in ops for t in view.nodes[name].inputs]
        fetched_sources = [split_tensor_name(t)[0] for t, home in fetch_home.items()
                           if home == i and split_tensor_name(t)[0] in view.sources]
        built.append(Partition(
            index=i,
            ops=tuple(ops),
            units=len(partitioned_units[i]) if partitioned_units else 0,
            inputs=tuple(t.tensor for t in transfers if i in t.consumers),
            outputs=tuple(t.tensor for t in transfers if t.producer == i),
            feeds=tuple(dict.fromkeys(t for t in used_inputs if t in view.feeds)),
            sources=tuple(dict.fromkeys(
                [split_tensor_name(t)[0] for t in used_inputs
                 if split_tensor_name(t)[0] in view.sources] + fetched_sources)),
            fetches=tuple(t for t, home in fetch_home.items() if home == i),
        ))
    return Plan(view=view, partition_size=partition_size,
                partitions=tuple(built), transfers=tuple(transfers))


def validate(plan):
    """Check the plan's invariants; raise InvalidPlanError listing every breach.

    Every copied op is in exactly one partition and state sources in none;
    producers run before consumers; every tensor read in a later partition
    is a transfer of a dtype that may cross runs; partitions respect
    partition_size unless they hold a single unit; every fetch has a home.
    Stateful ops therefore run once per step; state sources, which may be
    read by several partitions, are idempotent by construction (`optypes`).
    """
    view, problems = plan.view, []
    home = {}
    for p in plan.partitions:
        for op in p.ops:
            if op in home:
                problems.append(f"op '{op}' is in partitions {home[op]} and {p.index}")
            home[op] = p.index
            if op in view.sources:
                problems.append(f"state source '{op}' is copied into partition {p.index}")
        if len(p.ops) > plan.partition_size and p.units > 1:
            problems.append(f"partition {p.index} has {len(p.ops)} ops in {p.units} "
                            f"units, over partition_size={plan.partition_size}")
    problems += [f"op '{op}' is in no partition" for op in view.nodes if op not in home]
    problems += [f"unknown op '{op}' in partition {home[op]}"
                 for op in home if op not in view.nodes]

    transfers = {t.tensor: t for t in plan.transfers}
    for node in view.nodes.values():
        consumer = home.get(node.name)
        for tensor in node.inputs:
            producer = home.get(split_tensor_name(tensor)[0])
            if tensor in view.feeds or producer in (None, consumer) or consumer is None:
                continue
            transfer = transfers.get(tensor)
            if producer > consumer:
                problems.append(f"'{node.name}' (partition {consumer}) reads '{tensor}' "
                                f"produced later, in partition {producer}")
            elif transfer is None or consumer not in transfer.consumers:
                problems.append(f"'{tensor}' crosses from partition {producer} to "
                                f"{consumer} without a transfer")
        for src in node.control_inputs:
            producer = home.get(src)
            if producer is not None and consumer is not None and producer > consumer:
                problems.append(f"control edge '{src}' -> '{node.name}' runs backwards "
                                f"(partition {producer} -> {consumer})")
    for t in plan.transfers:
        info = view.tensor(t.tensor)
        if info.run_bound:
            problems.append(f"transfer '{t.tensor}' has dtype {info.dtype.name}, "
                            "which does not survive a Session.run")
        if home.get(split_tensor_name(t.tensor)[0]) != t.producer:
            problems.append(f"transfer '{t.tensor}' names the wrong producer")
        if not t.consumers or min(t.consumers) <= t.producer:
            problems.append(f"transfer '{t.tensor}' is not consumed after it is produced")
        if not isinstance(t.residency, Residency):
            problems.append(f"transfer '{t.tensor}' has no residency")

    fetched = [t for p in plan.partitions for t in p.fetches]
    for tensor in view.fetches:
        if fetched.count(tensor) != 1:
            problems.append(f"fetch '{tensor}' is produced by {fetched.count(tensor)} partitions")
    for name, node in view.sources.items():
        if node.inputs or node.control_inputs:
            problems.append(f"state source '{name}' has inputs and would re-run them")
    if problems:
        raise InvalidPlanError("invalid plan:\n  " + "\n  ".join(problems))


def make_plan(fetch_tensors, target_ops, fed_tensors, partition_size):
    """Analyse, group, partition and plan one request; the result is validated."""
    view = analyse(fetch_tensors, target_ops, fed_tensors)
    plan = build_plan(view, partition(view, units(view), partition_size), partition_size)
    validate(plan)
    return plan
