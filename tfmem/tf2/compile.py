"""Compile: one partition of a traced function as a callable ConcreteFunction of its own.

A `tf.function` traces to a FuncGraph.  tfmem plans that graph like a
Session request (fetches: the function's outputs; targets: its control
outputs, the variable updates; feeds: its inputs, captured variable handles
included).  Each partition then becomes a new function:

    partition ops (NodeDefs copied) + the constants they read
             (+ the ops of small inputs made from constants alone: constant_inputs)
    inputs:  transfers from earlier partitions, then the traced graph's inputs
             it reads (arguments and captured handles, fed unchanged)
    outputs: transfers to later partitions and the function's outputs it makes

The NodeDefs are imported into a fresh `tf.function` trace, whose automatic
control dependencies run every stateful op (a variable update) and keep
their order; the traced graph's own control edges between ops of the
partition are kept, those from other partitions dropped (running partitions
in order satisfies them).  Variable handles are the program's own captured
handles, fed as arguments: an update made inside is visible outside.

The user's graph is never changed: copies only.
"""

import dataclasses

import tensorflow as tf
from tensorflow.python.ops import handle_data_util

from tfmem.plan.analyse import canonical_input, split_tensor_name, tensor_bytes
from tfmem.run.compiling.rewrite import keep_colocation_within
from tfmem.tf2 import cubes, dedup, sorted_names
from tfmem.tf2.call_options import call_without_memory_optimizer

_HANDLE_DTYPES = (tf.resource, tf.variant)
# A transfer computed from constants alone, up to this size, is computed again in the
# partition that reads it (see constant_inputs).
CONSTANT_INPUT_MAX_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class PartitionFunction:
    """One compiled partition: what it is fed, what it returns, and how to call it."""
    index: int
    input_sources: tuple  # per argument: a transfer or a fed tensor of the traced graph
    output_sinks: tuple  # per output: the traced graph's tensor it stands for
    call: object  # (*tensors) -> list of tensors
    concrete: object  # the ConcreteFunction, kept alive while `call` is used


def function_key(partition, cut):
    """What a partition's function computes (`compile_partition`, `compile_with_streams`):
    its ops, the transfers and fed tensors it takes, what it returns, and `cut` (whether
    its plan has more than one partition, which decides dedup's reads).  Plans of one trace
    share a function where their partitions' keys agree, whatever their index."""
    return (tuple(partition.ops), tuple(partition.inputs), tuple(partition.feeds),
            tuple(partition.outputs), tuple(partition.fetches), tuple(partition.sources), cut)


def partition_graph_def(graph, view, partition, library, seen, read=lambda tensor: tensor,
                        constant=((), ())):
    """A GraphDef of the partition's ops and the constants (state sources) they read,
    every node named `sorted_names.encode` of the name Grappler sees in the whole
    function (`seen(op name)`), so that it orders a sum's inputs as there; `read`: the
    tensor a reader of a tensor reads (see tfmem.tf2.dedup); `constant`: (ops,
    constants) of inputs computed again inside (see constant_inputs)."""
    ops, sources = constant
    sources = tuple(dict.fromkeys(tuple(partition.sources) + sources))
    members = set(partition.ops) | set(ops)
    graph_def = tf.compat.v1.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    graph_def.library.CopyFrom(library)
    # in the traced graph's order: Grappler rewrites a chain of products node by node,
    # and the order it meets them in decides where a constant is multiplied in
    position = {op.name: index for index, op in enumerate(graph.get_operations())}
    for name in sorted(sources + ops + tuple(partition.ops), key=position.__getitem__):
        node = graph_def.node.add()
        node.CopyFrom(graph.get_operation_by_name(name).node_def)
        data = [_reference(read(inp), seen) for inp in node.input if not inp.startswith("^")]
        edges = view.nodes[name].control_inputs if name in view.nodes else ()
        control = [src for src in edges if src in members]
        del node.input[:]
        node.input.extend(data + ["^" + sorted_names.encode(seen(src)) for src in control])
        keep_colocation_within(node, members)
        if "_class" in node.attr:
            node.attr["_class"].list.s[:] = [
                b"loc:@" + sorted_names.encode(seen(c.decode()[5:])).encode()
                for c in node.attr["_class"].list.s]
        node.name = sorted_names.encode(seen(name))
    return graph_def


def constant_inputs(view, inputs):
    """(ops, their constants, inputs) of the partition's small inputs computed from
    constants alone (pure ops without control inputs, on constants): the ops to compute
    again inside the partition, in producer-first order.

    Grappler folds such an expression into its reader in the whole function (the
    `y - 1` of a power's gradient, which makes `pow(x, 2)` a square); read as an
    argument, the partition would compute `pow(x, 2.0)`, and differ in the last bits."""
    constant = {}  # op name -> whether it computes from constants alone

    def is_constant(name):
        if name not in constant:
            if name in view.sources:
                constant[name] = view.sources[name].type == "Const"
            else:
                node = view.nodes.get(name)
                constant[name] = bool(
                    node is not None and not node.side_effects and not node.control_inputs
                    and node.inputs and all(is_constant(op) for op in node.input_ops))
        return constant[name]

    ops, sources, replaced = {}, {}, []

    def add(name):
        if name in ops or name in sources:
            return
        if name in view.sources:
            sources[name] = None
            return
        for producer in view.nodes[name].input_ops:
            add(producer)
        ops[name] = None

    for tensor in inputs:
        producer = split_tensor_name(tensor)[0]
        if producer not in view.nodes or not is_constant(producer):
            continue  # (a piece's inputs include the function's own: not nodes)
        info = view.tensor(tensor)
        nbytes = tensor_bytes(info.dtype, info.shape)
        if nbytes is not None and nbytes <= CONSTANT_INPUT_MAX_BYTES:
            add(producer)
            replaced.append(tensor)
    return tuple(ops), tuple(sources), tuple(replaced)


def _reference(tensor, seen):
    """A GraphDef input `op` or `op:k` of the traced graph, in encoded names."""
    op_name, _, index = tensor.partition(":")
    return sorted_names.tensor_reference(seen(op_name), int(index or 0))


def seen_names(concrete):
    """{op name: the name Grappler sees} of a traced function: its inputs are the
    FunctionDef's arguments, named by TensorFlow's normalisation of the placeholders'
    names (lower case, '_' for '/'); every other op keeps its name."""
    arguments = [arg.name for arg in concrete.function_def.signature.input_arg]
    names = {t.op.name: arg for t, arg in zip(concrete.graph.inputs, arguments)}
    return lambda name: names.get(name, name)


def _flat_call(concrete):
    """The cheapest call of a ConcreteFunction on flat eager tensors (no tape, no
    structure), instantiated without Grappler's memory optimizer (see call_options)."""
    atomic = getattr(concrete, "_inference_function", None)
    if atomic is not None and hasattr(atomic, "call_flat"):
        def call(*args):
            return call_without_memory_optimizer(atomic.call_flat, args) or []
        return call

    def fallback(*args):  # other TensorFlow versions: the public, structured call
        return tf.nest.flatten(call_without_memory_optimizer(concrete, args))
    return fallback


def compile_partition(graph, plan, partition, library, seen, kept=None):
    """The PartitionFunction of `partition` of `plan`, traced from `graph` (a FuncGraph);
    `seen`: the names Grappler sees in the whole function (`seen_names`); `kept`: the
    copy of each equal computation Grappler keeps there (`dedup.kept_copies`)."""
    inputs = tuple(partition.inputs) + tuple(partition.feeds)
    outputs = tuple(dict.fromkeys(tuple(partition.outputs) + tuple(partition.fetches)))
    originals = [graph.get_tensor_by_name(name) for name in inputs]
    constant_ops, constant_sources, recomputed = constant_inputs(plan.view, partition.inputs)
    names = dedup.PartitionNames(
        seen, kept or {}, tuple(partition.ops) + tuple(partition.sources) + constant_ops
        + constant_sources, inputs)
    seen = names.seen
    graph_def = partition_graph_def(graph, plan.view, partition, library, seen, names.read,
                                    (constant_ops, constant_sources))
    if cubes.functions_run_on_cpu():
        cubes.write_out(graph_def, graph, plan.view, partition.ops,
                        lambda name: sorted_names.encode(seen(name)))
    recomputed = {canonical_input(_reference(name, seen)) for name in recomputed}
    specs = [tf.TensorSpec(t.shape, t.dtype, name=sorted_names.argument_name(
        seen(t.op.name), t.value_index)) for t in originals]
    encoded_inputs = [_reference(name, seen) for name in inputs]
    encoded_outputs = [_reference(name, seen) for name in outputs]

    read = {canonical_input(inp) for node in graph_def.node for inp in node.input
            if not inp.startswith("^")}

    def body(*args):
        for arg, original in zip(args, originals):
            if original.dtype in _HANDLE_DTYPES:  # variable shapes, TensorList element shapes
                handle_data_util.copy_handle_data(original, arg)
        if not graph_def.node:
            return []
        # an input whose readers read an equal one, or computed again here, is left out
        mapped = {name: arg for name, arg in zip(map(canonical_input, encoded_inputs), args)
                  if name in read and name not in recomputed}
        imported = tf.graph_util.import_graph_def(  # no prefix: the names as encoded
            graph_def, input_map=mapped,
            return_elements=[canonical_input(name) for name in encoded_outputs], name="")
        return list(imported)

    body.__name__ = f"tfmem_partition_{partition.index}"
    concrete = tf.function(body, input_signature=specs, autograph=False).get_concrete_function()
    return PartitionFunction(partition.index, inputs, outputs, _flat_call(concrete), concrete)

