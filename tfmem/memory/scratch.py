"""Scratch: the memory kernels allocate besides their outputs, measured once per kernel.

A convolution gradient on the CPU without oneDNN allocates an im2col buffer
many times its output (a [40,256,576] float buffer, 22.5 MiB, next to a
9 KiB filter gradient); cuDNN picks algorithms by workspace.  No static model
knows these sizes, so they are measured: each distinct *kernel configuration*
(op type, attributes, input dtypes and shapes, and the values of small integer
inputs such as a gradient's `input_sizes`) is run once, alone, in a scratch
graph and session of its own, with the user's session threads and zero-filled
inputs, in the kernel runner (a child process whose allocator no earlier step
has shaped: kernel_runner.py):

    scratch graph:   zeros[16,32,32,16] --+
                     zeros[3,3,16,16]  ---+--> Conv2DBackpropFilter (copy)
                     const [3,3,16,16] ---+        |
                                           step stats: op peak - live bytes

TensorFlow's step statistics (`RunOptions.SOFTWARE_TRACE`) report the bytes
the op allocated at its peak (`peak_bytes`) and what it still holds when it
returns (`live_bytes`, its outputs); the difference is its scratch.  Nothing
of the user's graph, session or variables is touched, and it works before the
user's first step, so budget mode plans with it from step one.  Stateful ops
and ops reading resources are never calibrated (running them has effects).

Results are cached per kernel configuration in a `ScratchCache` (one per
process by default), and saved to a JSON file when `TFMEM_SCRATCH_CACHE`
names one, so the next process plans without measuring again.  Figures
`tfmem.function` measures again after a step went over its prediction
replace stale ones there (`ScratchCache.correct`).
"""

import functools
import json
import logging
import math
import os
import threading

import psutil
import tensorflow as tf
from tensorflow.core.framework.node_def_pb2 import NodeDef
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.framework import tensor_util

from tfmem.plan import optypes
from tfmem.memory import dedup, kernel_runner
from tfmem.memory.emulated import emulated_memory_mib
from tfmem.memory.shapes import import_request
from tfmem import tf_private

log = logging.getLogger(__name__)

CACHE_ENV = "TFMEM_SCRATCH_CACHE"
# Cache keys of a configuration's extra output bytes (see workspace.py): this prefix + its key.
OUTPUTS = "outputs:"
# Cache keys of the bytes of a configuration's scratch allocated before its outputs.
EARLY = "early:"
_VALUE_LIMIT = 64  # integer inputs up to this many elements are passed by value
# Ops whose kernels allocate their outputs and nothing else (or return views).
_NO_SCRATCH = frozenset({
    "Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "EnsureShape", "CheckNumerics", "ReadVariableOp", "Const",
    "NoOp",
    "Abs", "Add", "AddN", "AddV2", "BiasAdd", "Cos", "Elu", "EluGrad", "Exp", "Log",
    "Maximum", "Minimum", "Mul", "Neg", "Pow", "RealDiv", "Relu", "Relu6", "ReluGrad",
    "Relu6Grad", "Rsqrt", "Sigmoid", "SigmoidGrad", "Sin", "Sqrt", "Square",
    "SquaredDifference", "Sub", "Tanh", "TanhGrad", "Sign", "Floor", "Reciprocal",
    "Cast", "ZerosLike", "OnesLike", "Fill", "Greater", "GreaterEqual", "Less",
    "LessEqual", "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "Select",
    "SelectV2", "FloorDiv", "FloorMod", "DivNoNan", "Pack", "Range",
    "BroadcastGradientArgs", "DynamicStitch",
}) | optypes.FEEDABLE_PLACEHOLDERS | optypes.SHAPE_ONLY | optypes.CONTROL_FLOW


def environment():
    """What besides the configuration decides a kernel's scratch: TensorFlow's version,
    the kernel library and the threads a kernel may split its work over."""
    return (tf.__version__, os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""))


class ScratchCache:
    """Scratch bytes per kernel configuration; saved to `path` (JSON) when given."""

    def __init__(self, path=None):
        self.path = path
        self._bytes = {}
        self._lock = threading.Lock()
        self.measured = 0  # configurations measured (not loaded) by this cache
        if path and os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as file:
                    self._bytes = {k: int(v) for k, v in json.load(file).items()}
            except (OSError, ValueError) as err:
                log.warning("ignoring the kernel scratch cache %s: %s", path, err)

    def get(self, key):
        return self._bytes.get(key)

    def update(self, measured):
        with self._lock:
            self._bytes.update(measured)
            self.measured += sum(1 for key in measured
                                 if not key.startswith((OUTPUTS, EARLY)))
            if measured:
                self._save()

    def correct(self, remeasured):
        """Take the figures of `remeasured` (a ScratchCache of kernels measured again, after
        a step went over its prediction) where they differ from this cache's, and save the
        file: a stale file is corrected for the next process too.  The number changed."""
        figures = remeasured.items()  # (outside this cache's lock: it may be this cache)
        with self._lock:
            changed = {key: value for key, value in figures if self._bytes.get(key) != value}
            self._bytes.update(changed)
            if changed:
                self._save()
        if changed and self.path:
            log.info("corrected %d kernel scratch figures in %s", len(changed), self.path)
        return len(changed)

    def items(self):
        with self._lock:
            return list(self._bytes.items())

    def _save(self):
        """Write the file whole, atomically: a temp file beside it, renamed over it (a
        reader, in this process or another, sees the old file or the new one)."""
        if not self.path:
            return
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        partial = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(partial, "w", encoding="utf-8") as file:
            json.dump(self._bytes, file, sort_keys=True, indent=0)
        os.replace(partial, self.path)

    def __len__(self):
        return len(self._bytes)


_DEFAULT = None


def default_cache():
    """The process's cache, read from and saved to $TFMEM_SCRATCH_CACHE when it is set."""
    global _DEFAULT  # pylint: disable=global-statement
    path = os.environ.get(CACHE_ENV) or None
    if _DEFAULT is None or _DEFAULT.path != path:
        _DEFAULT = ScratchCache(path)
    return _DEFAULT


def _calibratable(node):
    if node.stateful or node.side_effects or node.type in _NO_SCRATCH or not node.inputs:
        return False
    return not any(optypes.is_run_bound(o.dtype) or o.dtype in (tf.string, tf.variant)
                   for o in node.outputs)


def input_spec(tensor, constants=None):
    """(dtype, shape, value or None) of a scratch-graph tensor, or None if its shape is open.
    `constants`: {}, to share the values of equal constants between calls."""
    dims, unknown_rank = tf_private.static_shape(tensor)  # without making a TensorShape
    if unknown_rank or None in dims:
        return None
    dtype = tensor.dtype
    if dtype in _OPAQUE or tf_private.is_ref_dtype(dtype):
        return None
    value = None
    if dtype.is_integer and math.prod(dims) <= _VALUE_LIMIT:
        value = _static_value(tensor, {} if constants is None else constants)
    return dtype.name, tuple(dims), value


_OPAQUE = frozenset({tf.string, tf.variant, tf.resource})


def _static_value(tensor, constants):
    """A small integer tensor's value where shape inference knows it (shapes of inputs)."""
    op = tensor.op
    kind = op.type
    if kind == "ShapeN":
        source = op.inputs[tensor.value_index].shape
        return source.as_list() if source.is_fully_defined() else None
    if kind == "Const":  # what tf.get_static_value reads, once per distinct value
        proto = NodeDef.FromString(tf_private.serialized_node_def(op)).attr["value"].tensor
        key = proto.SerializeToString()
        if key not in constants:
            constants[key] = tensor_util.MakeNdarray(proto).tolist()
        return constants[key]
    if kind not in tf_private.STATIC_VALUE_TYPES:
        return None
    value = tf.get_static_value(tensor)
    return None if value is None else value.tolist()


def _input_bytes(specs):
    total = 0
    for dtype, shape, _ in specs:
        count = 1
        for dim in shape:
            count *= dim
        total += count * _dtype_size(dtype)
    return total


@functools.lru_cache(maxsize=None)
def _dtype_size(name):
    return tf.as_dtype(name).size


def _input_limit():
    """The most input bytes a calibration may allocate: a quarter of the available host
    memory, and of the emulated cap when there is one (an op too large for these is
    reported with no scratch, and the step's own statistics correct budget mode)."""
    limit = psutil.virtual_memory().available // 4
    cap = emulated_memory_mib()
    return min(limit, (cap << 20) // 4) if cap is not None else limit


def kernel_attrs(attrs):
    """What configures a kernel of the attributes `attrs` (`dedup.node_attrs`): all but
    the private ones ("_class", "_output_shapes", ...), values in hexadecimal."""
    return tuple((k, v.hex()) for k, v in attrs if not k.startswith("_"))


def kernel_key(op_type, attrs, specs, threads):
    """One string naming a kernel configuration in this environment (`attrs`:
    `kernel_attrs`)."""
    return json.dumps([environment(), threads, op_type, attrs, specs])


def session_config(threads):
    """No Grappler and no classic constant folding: they would compute the op at
    optimisation time instead of in the step being measured."""
    config = config_pb2.ConfigProto(intra_op_parallelism_threads=threads,
                                    inter_op_parallelism_threads=1)
    config.graph_options.optimizer_options.opt_level = config_pb2.OptimizerOptions.L0
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    config.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    return config


def threads_of(session):
    config = tf_private.config_of(session)
    return int(config.intra_op_parallelism_threads) if config is not None else 0


def input_value(spec):
    """A calibration input for `spec` (dtype, shape, value): the value where analysis
    knew it (a shape, an axis), else zeros."""
    dtype, shape, value = spec
    return tf.constant(value, dtype=dtype, shape=shape) if value is not None \
        else tf.zeros(shape, dtype)


def copy_kernel(node_def, name, inputs):
    """A copy of the op `node_def` describes, named `name`, reading `inputs`, in the
    default graph (free of its devices and private attributes).  Raises ValueError when
    the inputs do not fit it."""
    copy = tf.compat.v1.NodeDef()
    copy.CopyFrom(node_def)
    copy.name = name
    del copy.input[:]
    copy.input.extend(f"{name}_input{i}:0" for i in range(len(inputs)))
    copy.device = ""
    for attr in [a for a in copy.attr if a.startswith("_")]:
        del copy.attr[attr]
    graph = tf.compat.v1.get_default_graph()
    definition = tf.compat.v1.GraphDef(node=[copy])
    definition.versions.producer = graph.graph_def_versions.producer
    tf.graph_util.import_graph_def(
        definition, name="", input_map={f"{name}_input{i}:0": t for i, t in enumerate(inputs)})
    return graph.get_operation_by_name(name)


def _measure(configs, threads):
    """{key: scratch bytes, OUTPUTS + key: extra output bytes, EARLY + key: scratch bytes
    allocated before the outputs} for [(key, node_def, specs)], each op run alone once by
    the kernel runner."""
    graph = tf.Graph()
    ops = {}
    with graph.as_default():
        for number, (key, node_def, specs) in enumerate(configs):
            inputs = [input_value(s) for s in specs]
            try:
                op = copy_kernel(node_def, f"kernel{number}", inputs)
            except ValueError as err:  # an input value shape inference did not know
                log.debug("kernel scratch of %s not measured: %s", node_def.op, err)
                continue
            _hold_inputs(op, inputs)
            ops[key] = op.name
    scratch_bytes, extra, early = kernel_runner.run_alone(graph, list(ops.values()), threads)
    measured = {}
    for key, name in ops.items():
        measured[key] = scratch_bytes[name]
        measured[OUTPUTS + key] = extra[name]
        measured[EARLY + key] = early[name]
    return measured


def _hold_inputs(op, inputs):
    """Readers that run after `op` (`kernel_runner.HELD` names them) of its inputs shaped
    like one of its outputs, so that its kernel allocates its outputs instead of writing
    them into an input, as the simulator has it (in a step, a max pooling gradient's
    input is the activation its gradient reads next).  Other inputs stay free to take
    the kernel's scratch, as those dying at the op do in a step."""
    outputs = {(o.dtype, tuple(o.shape.as_list())) for o in op.outputs if o.shape.rank is not None}
    held = [t for t in inputs if (t.dtype, tuple(t.shape.as_list())) in outputs]
    if held:
        with tf.control_dependencies([op]):
            tf.group(*[tf.identity(t) for t in held], name=op.name + kernel_runner.HELD)


def op_scratch(metadata, name):
    """The bytes op `name` allocated at its peak beyond what it returned."""
    return max((max(m.peak_bytes - m.live_bytes for m in n.memory) if n.memory else 0
                for d in metadata.step_stats.dev_stats for n in d.node_stats
                if n.node_name == name), default=0)


def scratch_before_outputs(metadata, name):
    """The bytes of scratch op `name` allocated before its first output and still held
    when that output was allocated, from the allocation records of its step statistics.

    The order decides which free chunk of a BFC allocator each buffer gets: oneDNN's
    max pooling gradient, run without its forward op's workspace, allocates twice its
    pooled input before its output, and the output then takes a chunk almost twice its
    size.  The first record of an output's chunk bytes is the output; frees pair with
    allocations of the same bytes, the latest first.  With no output allocated (one
    written into an input), nothing is known to come before it: 0."""
    for dev in metadata.step_stats.dev_stats:
        for node in dev.node_stats:
            if node.node_name != name:
                continue
            outputs = {o.tensor_description.allocation_description.allocated_bytes
                       for o in node.output}
            for memory in node.memory:
                early = _held_at_first_output(
                    [r.alloc_bytes for r in memory.allocation_records], outputs)
                if early is not None:
                    return early
    return 0


def _held_at_first_output(records, outputs):
    """`scratch_before_outputs` of one allocator's records (bytes allocated, or freed when
    negative, in order) and its outputs' chunk bytes: None when no output is recorded."""
    first = next((i for i, nbytes in enumerate(records) if nbytes > 0 and nbytes in outputs),
                 None)
    if first is None:
        return None
    freed_at = {}  # allocation's record -> the record that freed it
    unfreed = {}  # bytes -> the records of allocations of that size not yet freed
    for index, nbytes in enumerate(records):
        if nbytes > 0:
            unfreed.setdefault(nbytes, []).append(index)
        elif unfreed.get(-nbytes):
            freed_at[unfreed[-nbytes].pop()] = index
    # Held across the output's allocation and freed later: scratch (never freed: a
    # kernel's cache, not scratch).
    return sum(records[i] for i in range(first)
               if records[i] > 0 and freed_at.get(i, first) > first)


def extra_output_bytes(metadata, op):
    """Bytes of the outputs op's kernel returned past the op's own (oneDNN's max pooling
    returns a workspace), from its step statistics."""
    return sum(o.tensor_description.allocation_description.requested_bytes
               for d in metadata.step_stats.dev_stats for n in d.node_stats
               if n.node_name == op.name for o in n.output if o.slot >= len(op.outputs))


def calibrate(graph, view, feed_shapes, session=None, cache=None):
    """{op name: scratch bytes} for the request's ops that allocate scratch.

    Configurations not in `cache` (default: `default_cache()`) are measured now,
    in a scratch graph and session of their own.
    """
    return calibrate_kernels(graph, view, feed_shapes, session, cache)[0]


def write_stale_cache(path, graph, view, feed_shapes, session=None):
    """Write a cache file at `path` recording every kernel configuration of the request
    with no scratch: what a file from another machine or TensorFlow release may say.
    Budget mode must find out from its steps; its tests and experiments start here."""
    calibrate(graph, view, feed_shapes, session, cache=ScratchCache(path))
    with open(path, encoding="utf-8") as file:
        stale = {key: 0 for key in json.load(file)}
    with open(path, "w", encoding="utf-8") as file:
        json.dump(stale, file)


_UNSEEN = object()


def calibrate_kernels(graph, view, feed_shapes, session=None, cache=None, scratch_graph=None):
    """({op name: scratch bytes}, {op name: extra output bytes}, {op name: kernel key},
    the scratch graph, {op name: scratch bytes allocated before its outputs}) of the
    request's calibratable ops: `calibrate`'s figures, the bytes of outputs their kernels
    return past the op's own (see workspace.py), what workspace.py needs to measure
    pairs in the same configurations, and `scratch_before_outputs`.  `scratch_graph`:
    `import_request(graph, view, feed_shapes)`, when the caller has made it."""
    cache = default_cache() if cache is None else cache
    threads = threads_of(session)
    candidates = [name for name, node in view.nodes.items() if _calibratable(node)]
    if not candidates:
        return {}, {}, {}, None, {}
    if scratch_graph is None:
        scratch_graph = import_request(graph, view, feed_shapes)
    keys, missing = {}, {}
    limit = _input_limit()
    ops, node_attrs, configured, constants = tf_private.ops_by_name(scratch_graph), {}, {}, {}
    specs_of = {}  # the user's tensor name -> input_spec of its copy (read by several kernels)
    for name in candidates:
        op = ops["s/" + name]
        tensors = view.nodes[name].inputs  # the copy's inputs, in order
        specs = [specs_of.get(t, _UNSEEN) for t in tensors]
        if any(s is _UNSEEN for s in specs):
            for i, (tensor, copied) in enumerate(zip(tensors, op.inputs)):
                if specs[i] is _UNSEEN:
                    specs[i] = specs_of[tensor] = input_spec(copied, constants)
        if any(s is None for s in specs) or _input_bytes(specs) > limit:
            continue
        attrs = dedup.node_attrs(tf_private.serialized_node_def(op), node_attrs)
        if attrs not in configured:
            configured[attrs] = kernel_attrs(attrs)
        key = kernel_key(op.type, configured[attrs], specs, threads)
        keys[name] = key
        if key not in missing and any(cache.get(prefix + key) is None
                                      for prefix in ("", OUTPUTS, EARLY)):
            missing[key] = (key, op.node_def, specs)
    if missing:
        measured = _measure(list(missing.values()), threads)
        cache.update(measured)
        scratch_figures = [v for k, v in measured.items()
                           if not k.startswith((OUTPUTS, EARLY))]
        log.info("measured the scratch memory of %d kernel configurations (%d with scratch, "
                 "largest %.1f MiB)", len(scratch_figures), sum(1 for v in scratch_figures if v),
                 max(scratch_figures, default=0) / (1 << 20))
    scratch = {name: cache.get(key) for name, key in keys.items() if cache.get(key)}
    extra = {name: cache.get(OUTPUTS + key) for name, key in keys.items()
             if cache.get(OUTPUTS + key)}
    early = {name: cache.get(EARLY + key) for name, key in keys.items()
             if cache.get(EARLY + key)}
    return scratch, extra, keys, scratch_graph, early
