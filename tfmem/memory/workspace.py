"""Workspace: outputs a kernel returns besides the op's own, and the scratch they save.

With oneDNN on, TensorFlow runs a max pooling as `_MklNativeMaxPool`, which
returns a second output the graph's MaxPool does not have: a workspace, one
byte per pooled element.  The pooling gradient run in the same graph reads it
and needs no scratch; run where the workspace does not exist (its forward op
in another partition, or alone in a calibration), the same gradient allocates
scratch of twice its pooled input instead (1.2 MiB for the test conv net's
first pooling, whose workspace is 0.15 MiB).  Both are measured, not assumed:

    forward op alone (kernel calibration)   -> bytes of outputs past the op's own
    forward op -> reader, in one graph      -> the reader's scratch beside it

and the simulator uses them per partition:

    forward op F with extra outputs   they are allocated with F's outputs and held
                                      until the last reader of F in the partition
                                      that uses them (freed at once when none runs
                                      there); a reader uses them when it measured
                                      less scratch beside F than alone
    reader G paired with F            in F's partition its paired scratch replaces
                                      its calibrated one; elsewhere, the calibrated
                                      (unpaired) figure stands
"""

import dataclasses
import json

import tensorflow as tf

from tfmem.memory import kernel_runner, scratch as kernels
from tfmem.plan.analyse import split_tensor_name

PAIRED = "paired:"  # cache keys of a reader's scratch beside its forward op


@dataclasses.dataclass(frozen=True)
class Workspaces:
    """What kernels return besides the op's outputs, and what that saves their readers."""
    extra: dict = dataclasses.field(default_factory=dict)  # forward op -> extra output bytes
    # reader op -> (forward op, the reader's scratch bytes when both run in one partition)
    paired: dict = dataclasses.field(default_factory=dict)

    def __bool__(self):
        return bool(self.extra)


def measure(graph, view, feed_shapes, session=None, cache=None, scratch_graph=None):
    """({op name: scratch bytes}, Workspaces, {op name: scratch bytes allocated before its
    outputs}) of the request: `scratch.calibrate`'s figures, the workspaces and paired
    scratch of the ops whose kernels return extra outputs (measured once per
    configuration pair, cached like the scratch), and `scratch.scratch_before_outputs`.
    `scratch_graph`: `shapes.import_request(graph, view, feed_shapes)`, when the caller
    has made it."""
    cache = kernels.default_cache() if cache is None else cache
    scratch, extra, keys, scratch_graph, early = kernels.calibrate_kernels(
        graph, view, feed_shapes, session, cache, scratch_graph)
    if not extra:
        return scratch, Workspaces(), early
    pairs = {}  # reader -> (forward, pair key, forward's output index, reader's input index)
    for name, key in keys.items():
        for position, tensor in enumerate(view.nodes[name].inputs):
            forward, index = split_tensor_name(tensor)
            if forward in extra and forward in keys:
                pair_key = PAIRED + json.dumps([key, keys[forward], int(index), position])
                pairs[name] = (forward, pair_key, int(index), position)
                break
    missing = {k: (reader, forward, index, position)
               for reader, (forward, k, index, position) in pairs.items() if cache.get(k) is None}
    if missing:
        cache.update(_measure_pairs(scratch_graph, missing, kernels.threads_of(session)))
    # A reader that needs less scratch beside its forward op than alone uses the workspace
    # (the pooling gradient); the others (the next layer, a ShapeN) only read the output.
    paired = {reader: (forward, cache.get(k) or 0) for reader, (forward, k, _, _) in pairs.items()
              if (cache.get(k) or 0) < scratch.get(reader, 0)}
    return scratch, Workspaces(dict(extra), paired), early


def _measure_pairs(scratch_graph, pairs, threads):
    """{pair key: the reader's scratch} for {pair key: (reader, forward, forward's output
    index, reader's input index)}: both ops copied into a graph of their own, the reader
    fed the forward op's output, every other input zeros (as the calibration)."""
    graph = tf.Graph()
    readers = {}
    with graph.as_default():
        for number, (key, (reader, forward, index, position)) in enumerate(pairs.items()):
            forward_op = scratch_graph.get_operation_by_name("s/" + forward)
            reader_op = scratch_graph.get_operation_by_name("s/" + reader)
            copied = _copy(forward_op, f"forward{number}",
                           [_zeros(t) for t in forward_op.inputs])
            if copied is None:
                continue
            inputs = [copied.outputs[index] if i == position else _zeros(t)
                      for i, t in enumerate(reader_op.inputs)]
            op = _copy(reader_op, f"reader{number}", inputs)
            if op is not None:
                readers[key] = op
    measured = {key: 0 for key in pairs}
    scratch_bytes = kernel_runner.run_alone(graph, [op.name for op in readers.values()],
                                            threads)[0]
    measured.update({key: scratch_bytes[op.name] for key, op in readers.items()})
    return measured


def _zeros(tensor):
    spec = kernels.input_spec(tensor)
    return None if spec is None else kernels.input_value(spec)


def _copy(op, name, inputs):
    """A copy of `op` named `name` reading `inputs`, or None when one cannot be made."""
    if any(t is None for t in inputs):
        return None
    try:
        return kernels.copy_kernel(op.node_def, name, inputs)
    except ValueError:
        return None
