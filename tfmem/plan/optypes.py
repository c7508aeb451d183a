"""One table that classifies ops for partitioning, by op type, dtype and edges.

Three questions decide how an op may be partitioned:

* Must it be fed?  Placeholders have no value of their own.
* Does it name long-lived state?  Variables, hash tables, queues and iterators
  are created by a *state source* op whose kernel owns (or looks up) the
  resource by name.  A copy of such an op could create a second, empty
  resource, so state sources are never copied: every partition that needs one
  maps its consumers to the original op, which is idempotent to run.
  Input-free constants are mapped to the original the same way: they are
  stateless, and import-time shape inference needs their values (a TensorList's
  element shape, say), which a copy fed across a boundary would hide.
* Does its kernel hold a random stream?  A stateful random op draws the next
  numbers of one stream per op *name* in a session (TensorFlow caches the
  kernels of stateful ops by node name), so the plain session and every plan
  share a stream only if they all run the user's own op (see `analyse`).
* Does an edge carry something that cannot leave a `Session.run`?  Resource
  handles and reference tensors are only meaningful inside the run that made
  them (TensorArrays and v1 while-loop stacks die with the run), so producer
  and consumer of such an edge stay in one partition.

v1 control flow (frames and cond regions) is classified here by op type and
grouped in `units.py`.
"""

import functools

from tensorflow.python.framework import dtypes

from tfmem import tf_private

PLACEHOLDERS = frozenset({"Placeholder", "PlaceholderV2"})  # must be fed
# Everything a request may feed by placeholder; a PlaceholderWithDefault need not be.
FEEDABLE_PLACEHOLDERS = PLACEHOLDERS | {"PlaceholderWithDefault"}
def has_fixed_size(dtype):
    """Whether every element of `dtype` takes `dtype.size` bytes: not strings,
    resources or variants, whose tensors hold pointers to data counted elsewhere."""
    return dtype.is_numpy_compatible and dtype.size != 0 and \
        dtype.name not in ("string", "resource", "variant")


# Ops that create one variable (or, _VarHandlesOp, several) and own its value.
VARIABLES = frozenset({"VarHandleOp", "_VarHandlesOp", "VariableV2", "Variable"})

# State sources tfmem knows by name; `is_state_source` also accepts any other
# input-free op that returns a resource or reference and is shared by name.
STATE_SOURCES = VARIABLES | frozenset({
    "HashTable", "HashTableV2", "MutableHashTable", "MutableHashTableV2",
    "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2",
    "MutableDenseHashTable", "MutableDenseHashTableV2",
    "FIFOQueue", "FIFOQueueV2", "PaddingFIFOQueue", "PaddingFIFOQueueV2",
    "RandomShuffleQueue", "RandomShuffleQueueV2",
    "PriorityQueue", "PriorityQueueV2",
    "OneShotIterator", "Iterator", "IteratorV2", "MultiDeviceIterator",
    "ConditionalAccumulator", "SparseConditionalAccumulator",
    "ResourceConditionalAccumulator", "MutexV2",
})

ENTER = frozenset({"Enter", "RefEnter"})
EXIT = frozenset({"Exit", "RefExit"})
NEXT_ITERATION = frozenset({"NextIteration", "RefNextIteration"})
SWITCH = frozenset({"Switch", "RefSwitch"})
MERGE = frozenset({"Merge", "RefMerge"})
# Ops whose liveness is not their inputs' (v1 control flow): their control
# edges carry meaning beyond order, so analysis never drops them or their readers.
CONTROL_FLOW = ENTER | EXIT | NEXT_ITERATION | SWITCH | MERGE | frozenset({
    "LoopCond", "ControlTrigger"})

# Ops that read only their input's shape: run beside the producer, they let a
# large tensor die early and only a small shape vector crosses a boundary.
SHAPE_ONLY = frozenset({"Shape", "Size", "Rank"})

# Ops Grappler's arithmetic optimizer regroups (plan/units.py, rule 4): trees of
# sums become one AddN, whose inputs it sorts by name; chains of one
# associative op are reordered to minimise broadcasts; a common factor of
# products or quotients is hoisted out of a sum.
SUMS = frozenset({"Add", "AddV2", "AddN", "AccumulateNV2"})
PRODUCTS = frozenset({"Mul"})
QUOTIENTS = frozenset({"Div", "RealDiv"})
# Ops Grappler's model pruner removes before the arithmetic optimizer runs (when
# no control edge touches them; an IdentityN port only when it is not fetched),
# so a chain of products or a tree of sums continues through them.
PRUNED_FORWARDS = frozenset({"Identity", "IdentityN", "StopGradient"})

# Stateful ops whose kernel keeps a random stream (Philox state seeded from the
# op's seed/seed2 attrs) that advances on every run.
RANDOM_STREAM = frozenset({
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "ParameterizedTruncatedNormal", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
    "RandomShuffle", "Multinomial", "RandomCrop",
    "SampleDistortedBoundingBox", "SampleDistortedBoundingBoxV2",
    "AllCandidateSampler", "UniformCandidateSampler", "LogUniformCandidateSampler",
    "LearnedUnigramCandidateSampler", "FixedUnigramCandidateSampler",
    "ThreadUnsafeUnigramCandidateSampler",
})

# Stateful ops that call functions.  TensorFlow lowers them into the calling
# graph with node names derived from the caller's name, so the random ops of
# their bodies also keep one stream per caller name.
STATEFUL_CALLS = frozenset({"While", "If", "Case", "StatefulPartitionedCall"})

_SHARING_ATTRS = ("shared_name", "container")


@functools.lru_cache(maxsize=None)
def is_run_bound(dtype):
    """True for dtypes that must not cross a `Session.run` boundary."""
    return dtype.base_dtype == dtypes.resource or dtype != dtype.base_dtype


def is_state_source(op, kind=None):
    """True for ops that own or look up long-lived state by name; `kind`: `op.type`,
    when the caller has it (each read is a call into TensorFlow's C API)."""
    if (op.type if kind is None else kind) in STATE_SOURCES:
        return True
    if op.inputs or not op.outputs:
        return False
    if not all(is_run_bound(t.dtype) for t in op.outputs):
        return False
    names = {a.name for a in op.op_def.attr}
    return all(a in names for a in _SHARING_ATTRS)


def is_source(op, kind=None):
    """True for ops every partition maps to the original instead of copying; `kind`:
    `op.type`, when the caller has it."""
    kind = op.type if kind is None else kind
    if kind == "Const":
        return not op.control_inputs
    return is_state_source(op, kind)


# Ops that write a resource variable (its handle their first input) in place, unless
# another tensor still holds the variable's buffer: then the kernel gives the variable a
# new buffer (TensorFlow's copy-on-write) and the old one lives on with that tensor.
VARIABLE_UPDATES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
VARIABLE_UPDATE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")


def updates_variable(node):
    """True for an op that writes the resource variable its first input is a handle of."""
    return bool(node.inputs) and (node.type in VARIABLE_UPDATES
                                  or node.type.startswith(VARIABLE_UPDATE_PREFIXES))


# The only types `reads_state` holds for.
STATE_READS = frozenset({"ReadVariableOp", "Identity"})


def reads_state(node, sources):
    """True for an op whose output is a view of a variable's buffer (a variable read).

    Such a tensor costs no device memory of its own, and swapping it would
    only add a copy: it stays on the device.
    """
    if node.type == "ReadVariableOp":
        return True
    if node.type == "Identity" and node.inputs:
        producer = node.inputs[0].rpartition(":")[0]
        return producer in sources and sources[producer].outputs[0].dtype != \
            sources[producer].outputs[0].dtype.base_dtype
    return False


def _function_names(attrs):
    for value in attrs:
        if value.HasField("func"):
            yield value.func.name
        elif value.HasField("list"):
            yield from (f.name for f in value.list.func)


def _function_draws(graph, name, seen):
    """True when the graph's function `name`, or one it calls, runs a random-stream op."""
    if name in seen:
        return False
    seen.add(name)
    function = tf_private.graph_function(graph, name)
    if function is None:
        return False
    for node in function.definition.node_def:
        if node.op in RANDOM_STREAM or any(
                _function_draws(graph, n, seen)
                for n in [node.op, *_function_names(node.attr.values())]):
            return True
    return False


def draws_random_stream(op, kind=None):
    """True for an op whose kernels keep random streams: a random op, or a stateful
    call (a v2 loop or cond, a tf.function) whose body runs one; `kind`: `op.type`,
    when the caller has it."""
    kind = op.type if kind is None else kind
    if kind in RANDOM_STREAM:
        return True
    if kind not in STATEFUL_CALLS:
        return False
    seen = set()
    return any(_function_draws(op.graph, name, seen)
               for name in _function_names(op.node_def.attr.values()))
