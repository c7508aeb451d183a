"""Random streams that outlive a plan: each stream op runs in a function of its own per trace.

A stateful random op (and a loop, cond or call whose body runs one: see
`optypes.draws_random_stream`) keeps its Philox state in its kernel, and the
kernel lives as long as the instantiation of the function it runs in.  A plan
compiles its partitions into new functions, so in budget mode, where one
trace may get several plans (a fed shape the earlier plans do not fit, a
re-plan after learning), a new plan would start every stream again from its
seed; `tf.function` keeps one stream per op per trace.

A nested call does not help: TensorFlow instantiates a function called from
inside another function once per *caller*.  Each component function of a
multi-device function gets that function's own library
(`ProcessFunctionLibraryRuntime::InstantiateMultiDevice` sets
`opts.lib_def`), the overlay runtime its kernels see adds that library to
every nested instantiation (`FunctionLibraryRuntimeOverlay::Instantiate`),
and the instantiation cache is keyed by it (`Canonicalize`, `_lib_def`).
Measured on TensorFlow 2.21: two functions calling one `_noinline` function
drew from two streams.  A function called eagerly, from Python, is
instantiated once (the eager kernel cache), whoever calls it.

So a partition holding stream ops runs as a short chain of eager calls:

    partition i:  [ops before r1] -> r1 -> [ops between] -> r2 -> [ops after]
                                     ^ one function per op and trace, shared
                                       by every plan of that trace

A random op whose inputs the trace fixes (dropout's `Shape` of an
activation of static shape) draws first, fed those values, and the
partition is not cut for it: its stream does not depend on what runs
around it.

The pieces between are compiled as partitions of their own
(`compile.compile_partition`), named as in the whole function, so sums keep
their order (`sorted_names`).  A tensor lives in the chain until its last
reader there has run.
"""

import dataclasses

import tensorflow as tf

from tfmem.plan.optypes import RANDOM_STREAM, draws_random_stream
from tfmem.tf2.compile import PartitionFunction, compile_partition


def _reads(graph, name):
    return [t.name for t in graph.get_operation_by_name(name).inputs]


def _piece(graph, index, ops, sources, consumed_later, extra_outputs=()):
    """A Partition of `ops` (a run of one partition's ops) for compile_partition."""
    members = set(ops)
    inputs, used_sources, outputs = [], [], []
    for name in ops:
        for tensor in _reads(graph, name):
            producer = tensor.rpartition(":")[0]
            if producer in members:
                continue
            if producer in sources:
                used_sources.append(producer)
            else:
                inputs.append(tensor)
        for out in graph.get_operation_by_name(name).outputs:
            if out.name in consumed_later:
                outputs.append(out.name)
    outputs += [t for t in extra_outputs if t not in outputs]
    used_sources += [t.rpartition(":")[0] for t in extra_outputs
                     if t.rpartition(":")[0] in sources]
    return _Piece(index, tuple(ops), tuple(dict.fromkeys(inputs)),
                  tuple(dict.fromkeys(outputs)), tuple(dict.fromkeys(used_sources)))


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Duck-types plan.build.Partition for compile_partition: every read is an input."""
    index: int
    ops: tuple
    inputs: tuple
    outputs: tuple
    sources: tuple
    feeds: tuple = ()
    fetches: tuple = ()


class TraceStreams:
    """The stream functions of one trace: one per stream op, compiled once, shared by
    every plan of the trace (see the module docstring)."""

    def __init__(self, graph):
        self.graph = graph
        self._functions = {}  # op name -> PartitionFunction

    def draws(self, name):
        return draws_random_stream(self.graph.get_operation_by_name(name))

    def static_inputs(self, name):
        """{input tensor name: its value} of a random op whose inputs the trace fixes (a
        shape of static dims), else None: such an op can draw before its partition runs."""
        op = self.graph.get_operation_by_name(name)
        if op.type not in RANDOM_STREAM:
            return None
        values = {t.name: tf.get_static_value(t) for t in op.inputs}
        if any(v is None for v in values.values()):
            return None
        return {t.name: tf.constant(values[t.name], t.dtype) for t in op.inputs}

    def function(self, plan, name, sources, library, seen):
        function = self._functions.get(name)
        if function is None:
            op = self.graph.get_operation_by_name(name)
            piece = _piece(self.graph, 0, (name,), sources, (),
                           extra_outputs=[t.name for t in op.outputs])
            function = compile_partition(self.graph, plan, piece, library, seen)
            self._functions[name] = function
        return function


def compile_with_streams(graph, plan, partition, library, seen, streams, kept=None):
    """The PartitionFunction of `partition`: compile_partition's, or, when the partition
    runs stream ops, a chain of pieces whose stream ops are `streams`' shared functions."""
    if not any(streams.draws(name) for name in partition.ops):
        return compile_partition(graph, plan, partition, library, seen, kept)
    sources = set(partition.sources)
    # A random op whose inputs the trace fixes draws first (its own stream does not care
    # what runs around it): one call, and no cut in the partition.
    constants, first = {}, []
    for name in partition.ops:
        values = streams.static_inputs(name) if streams.draws(name) else None
        if values is not None:
            constants.update(values)
            first.append(name)
    runs, current = [((name,), True) for name in first], []
    for name in partition.ops:
        if name in first:
            continue
        if streams.draws(name):
            if current:
                runs.append((tuple(current), False))
            runs.append(((name,), True))
            current = []
        else:
            current.append(name)
    if current:
        runs.append((tuple(current), False))
    outputs = tuple(dict.fromkeys(tuple(partition.outputs) + tuple(partition.fetches)))
    functions = []
    for position, (ops, is_stream) in enumerate(runs):
        later = {t for later_ops, _ in runs[position + 1:] for op in later_ops
                 for t in _reads(graph, op)} | set(outputs)
        if is_stream:
            functions.append(streams.function(plan, ops[0], sources, library, seen))
            continue
        # A fetched state source (a constant returned as is) comes from the last piece.
        extra = [t for t in outputs if t.rpartition(":")[0] in sources] \
            if position == len(runs) - 1 else ()
        piece = _piece(graph, partition.index, ops, sources, later, extra)
        functions.append(compile_partition(graph, plan, piece, library, seen, kept))
    if runs[-1][1]:  # the chain ends with a stream op: fetched sources need a piece
        extra = [t for t in outputs if t.rpartition(":")[0] in sources]
        if extra:
            piece = _piece(graph, partition.index, (), sources, (), extra)
            functions.append(compile_partition(graph, plan, piece, library, seen, kept))
    inputs = tuple(partition.inputs) + tuple(partition.feeds)
    return PartitionFunction(partition.index, inputs, outputs,
                             _chain(functions, inputs, outputs, constants),
                             tuple(f.concrete for f in functions))


def _chain(functions, inputs, outputs, constants):
    """One call running `functions` in order, each fed by name from the arguments, the
    `constants` and the earlier functions' results; each value is dropped after its
    last reader."""
    last_reader = {}
    for position, function in enumerate(functions):
        for name in function.input_sources:
            last_reader[name] = position
    kept = set(outputs) | set(inputs) | set(constants)
    drops = [[] for _ in functions]
    for name, position in last_reader.items():
        if name not in kept:
            drops[position].append(name)

    def call(*args):
        values = dict(constants)
        values.update(zip(inputs, args))
        for function, drop in zip(functions, drops):
            results = function.call(*[values[name] for name in function.input_sources])
            values.update(zip(function.output_sinks, results))
            for name in drop:
                del values[name]
        return [values[name] for name in outputs]
    return call
