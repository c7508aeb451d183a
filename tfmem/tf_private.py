"""Every private TensorFlow attribute tfmem reads or calls, in one place.

tfmem needs a few things TensorFlow has no public API for: session callables
built from `CallableOptions`, `Session.run`'s own fetch handler and feed
expansions, a tensor's cached static shape, a graph's functions, setting an
op's device.  Each is one small function here, so that a TensorFlow upgrade
that renames one breaks this file and nothing else.  Checked on TensorFlow
2.21.  TensorFlow is imported on first call, never when tfmem is imported.
"""


def _client_session():
    from tensorflow.python.client import session as tf_session  # pylint: disable=import-outside-toplevel
    return tf_session


# Sessions -------------------------------------------------------------------

def makes_callables(session):
    """Whether `session` builds callables from CallableOptions (a BaseSession does)."""
    return hasattr(session, "_make_callable_from_options")


def make_callable(session, callable_options):
    """A raw session callable: `call(*feed_values, run_metadata=None)`."""
    return session._make_callable_from_options(callable_options)  # pylint: disable=protected-access


def is_closed(session):
    """Whether `close()` was called on `session` (False for objects that do not say)."""
    return getattr(session, "_closed", False)


def session_run(session, options, feeds, fetches, targets, metadata):
    """`Session.run`'s C path: TF_SessionRun with TF_Output feeds/fetches and TF_Operation targets."""
    return session._call_tf_sessionrun(  # pylint: disable=protected-access
        options, feeds, fetches, targets, metadata)


def extend_graph(session):
    """Let `session` take in the ops added to its graph since its last run (as every
    Session call does first)."""
    session._extend_graph()  # pylint: disable=protected-access


def config_of(session):
    """The ConfigProto `session` was created with (None: TensorFlow's defaults)."""
    return getattr(session, "_config", None)


def c_session(session):
    """The C API's TF_Session of a Python session (partial runs: see run/executing/partial_run.py)."""
    return session._session  # pylint: disable=protected-access


def fetch_handler(graph, fetches, feeds_by_ref):
    """`Session.run`'s fetch handler: its checks and the structure of what it returns."""
    return _client_session()._FetchHandler(graph, fetches, feeds_by_ref)  # pylint: disable=protected-access


def feed_expansions():
    """(key type, fetch fn, feed fn, feed-for-partial-run fn) registered with `Session.run`."""
    return _client_session()._REGISTERED_EXPANSIONS  # pylint: disable=protected-access


def convert_to_numpy_obj(np_dtype, value):
    """`Session.run`'s conversion of a Python number fed for a tensor of `np_dtype`."""
    return _client_session()._convert_to_numpy_obj(np_dtype, value)  # pylint: disable=protected-access


# Graphs, ops and tensors ------------------------------------------------------

def static_shape(tensor):
    """(dims, unknown_rank) of `tensor` as the graph caches it, without building a TensorShape."""
    return tensor._shape  # pylint: disable=protected-access


def graph_function(graph, name):
    """The function `name` defined in `graph` (or its outer graphs), or None."""
    return graph._get_function(name)  # pylint: disable=protected-access


def unfinalize(graph):
    """Let ops be added to a finalized graph again (see run/compiling/graph_growth.py)."""
    graph._unsafe_unfinalize()  # pylint: disable=protected-access


def set_device(op, device):
    """Set the device of an existing op (the placement pass's sole mutation of user ops)."""
    op._set_device(device)  # pylint: disable=protected-access


def declared_input_types(op):
    """The input dtypes `op` declares (reference dtypes included), not its inputs' dtypes."""
    return op._input_types  # pylint: disable=protected-access


def is_ref_dtype(dtype):
    """Whether `dtype` is a TF1 reference dtype (`float32_ref`)."""
    return dtype._is_ref_dtype  # pylint: disable=protected-access


def tf_output(tensor):
    """The C API's TF_Output for a graph tensor."""
    return tensor._as_tf_output()  # pylint: disable=protected-access


def c_op(op):
    """The C API's TF_Operation of a graph op."""
    return op._c_op  # pylint: disable=protected-access


def creation_index(op):
    """The position of `op` among its graph's ops in the order they were created."""
    return op._id  # pylint: disable=protected-access


def is_function_graph(graph):
    """Whether `graph` is a FuncGraph (a tf.function's trace)."""
    from tensorflow.python.framework import func_graph  # pylint: disable=import-outside-toplevel
    return isinstance(graph, func_graph.FuncGraph)


def import_beside(graph, graph_def, tensors, controls):
    """Import `graph_def` into `graph` under its own names, reading ops already there:
    `tensors` {input name: Tensor}, `controls` {control input name: Operation}.

    Unlike `import_graph_def`, names are never made unique: an op named like an existing
    op, or like an existing name scope ("a/b" once "a/b/c" is there), is an error
    (InvalidArgumentError "... already exists"), and nothing is imported.  Colocation
    may name ops already in `graph`."""
    from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import c_api_util, function  # pylint: disable=import-outside-toplevel
    scoped = c_api_util.ScopedTFImportGraphDefOptions()
    options = scoped.options
    c_api.TF_ImportGraphDefOptionsSetPrefix(options, "")
    c_api.TF_ImportGraphDefOptionsSetUniquifyNames(options, False)
    c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
    for name, tensor in tensors.items():
        op_name, _, index = name.partition(":")
        c_api.TF_ImportGraphDefOptionsAddInputMapping(options, op_name, int(index or 0),
                                                      tensor._as_tf_output())  # pylint: disable=protected-access
    for name, op in controls.items():
        c_api.TF_ImportGraphDefOptionsRemapControlDependency(options, name, op._c_op)  # pylint: disable=protected-access
    with graph._mutation_lock():  # pylint: disable=protected-access
        buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
        try:
            with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
                results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options)
            c_api_util.ScopedTFImportGraphDefResults(results)  # frees them
        finally:
            c_api.TF_DeleteBuffer(buffer)
        # The Python ops, each with its NodeDef's device as it is (import_graph_def's
        # post-processing re-derives devices through device scopes, and costs twice this)
        graph._add_new_tf_operations(compute_devices=False)  # pylint: disable=protected-access
    for defined in function.from_library(graph_def.library) if graph_def.library.function else ():
        defined.add_to_graph(graph)  # the Python side of functions the import added


def import_for_shapes(graph, serialized, prefix, tensors, library=None):
    """Import the serialized GraphDef `serialized` into `graph` under `prefix`, each input
    named in `tensors` ({tensor name: Tensor of `graph`}) read from that tensor;
    `library`: the FunctionDefLibrary it holds, when it holds functions.

    What `import_graph_def` does for a graph that only answers questions (shapes,
    constant values) and never runs: TensorFlow infers every shape as it imports, and
    the Python ops are made bare, without import_graph_def's post-processing (devices
    derived again through device functions, colocations propagated, control flow
    contexts checked), which costs three times the import itself; their names are not
    reserved, so `graph` takes no more ops afterwards.  Colocation
    constraints are not checked: a copy of part of a graph may name ops left out.
    Raises ValueError for a GraphDef that does not import (a shape that does not fit)."""
    from tensorflow.python.client import pywrap_tf_session as c_api  # pylint: disable=import-outside-toplevel
    from tensorflow.python.framework import c_api_util, errors, function, ops  # pylint: disable=import-outside-toplevel
    scoped = c_api_util.ScopedTFImportGraphDefOptions()
    options = scoped.options
    c_api.TF_ImportGraphDefOptionsSetPrefix(options, prefix)
    c_api.TF_ImportGraphDefOptionsSetUniquifyNames(options, True)
    c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
    for name, tensor in tensors.items():
        op_name, _, index = name.rpartition(":")
        c_api.TF_ImportGraphDefOptionsAddInputMapping(options, op_name, int(index),
                                                      tensor._as_tf_output())  # pylint: disable=protected-access
    with graph._mutation_lock():  # pylint: disable=protected-access
        buffer = c_api.TF_NewBufferFromString(serialized)
        try:
            with graph._c_graph.get() as c_graph:  # pylint: disable=protected-access
                results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options)
            c_api_util.ScopedTFImportGraphDefResults(results)  # frees them
        except errors.InvalidArgumentError as exc:
            raise ValueError(str(exc)) from None
        finally:
            c_api.TF_DeleteBuffer(buffer)
        # Bare Python ops: registered in the graph with their outputs, none of the
        # bookkeeping of ops made to run (attribute scopes, gradient overrides,
        # colocation stacks, names reserved for new ops), which costs as much again.
        for c_op in graph.new_operations():
            ops.Operation._from_c_op(c_op, graph)  # pylint: disable=protected-access
    with graph.as_default():  # (outside a graph, add_to_graph adds to the eager context)
        for defined in function.from_library(library) if library is not None else ():
            defined.add_to_graph(graph)  # the Python side of the functions it imported


# The op types whose outputs `tf.get_static_value` evaluates (tensor_util._ConstantValue);
# for any other op it returns None.
STATIC_VALUE_TYPES = frozenset({
    "Const", "Shape", "Size", "Rank", "Range", "Cast", "Concat", "ConcatV2", "Pack", "Unpack",
    "Split", "Fill", "Equal", "NotEqual", "StopGradient", "CheckNumericsV2",
    "DebugIdentityV2", "Identity"})


def serialized_node_def(op):
    """`op.node_def` serialized, without parsing it into a NodeDef."""
    return op._node_def  # pylint: disable=protected-access


def ops_by_name(graph):
    """{name: op} of `graph`'s ops now, for many lookups: `in` and `[]` on it take about a
    microsecond, where get_operation_by_name takes 20 us to miss.  Getting it costs about
    0.2 us per op of the graph."""
    return graph._nodes_by_name  # pylint: disable=protected-access


def has_functions(graph):
    """Whether functions are defined in `graph` itself (not its outer graphs)."""
    return bool(graph._functions)  # pylint: disable=protected-access


def function_library(graph, skip):
    """A FunctionDefLibrary of the functions defined in `graph` whose names are not in
    `skip`, with the gradients registered for them (TF1 `Defun`)."""
    from tensorflow.core.framework import function_pb2  # pylint: disable=import-outside-toplevel
    library = function_pb2.FunctionDefLibrary()
    for name, function in graph._functions.items():  # pylint: disable=protected-access
        if name in skip:
            continue
        library.function.add().CopyFrom(function.definition)
        gradient = getattr(function, "grad_func_name", None)
        if gradient:
            library.gradient.add(function_name=name, gradient_func=gradient)
    return library


# tf.function and Keras ----------------------------------------------------------

def canonical_inputs(tf_function, args, kwargs):
    """What a `tf.function`'s own call does first: defaults filled in, numpy made tensors."""
    from tensorflow.python.eager.polymorphic_function import function_type_utils  # pylint: disable=import-outside-toplevel
    return function_type_utils.canonicalize_function_inputs(
        args, kwargs, tf_function._function_type,  # pylint: disable=protected-access
        tf_function._default_values, tf_function._is_pure)  # pylint: disable=protected-access


def keras_autoconvert_optionals(model, step):
    """Keras 3's wrapper of a train step that turns optional inputs into tensors."""
    return model._autoconvert_optionals(step)  # pylint: disable=protected-access


# Profiler (tfmem.tf2.profiled_peaks) ----------------------------------------------

def start_profiler(directory):
    """A started profiler session writing under `directory`, or None while another runs.

    TensorFlow's own session object, not `tf.profiler.experimental.start`, whose
    module-wide session is the user's."""
    from tensorflow.python.framework import errors  # pylint: disable=import-outside-toplevel
    from tensorflow.python.profiler.internal import _pywrap_profiler  # pylint: disable=import-outside-toplevel
    session = _pywrap_profiler.ProfilerSession()
    try:
        # TensorFlow's default options (host tracer level 2: the allocators' events; no
        # Python tracer). 2.21 ignores Python ints given here, with a warning.
        session.start(directory, {})
    except errors.AlreadyExistsError:
        return None
    return session


def trace_marker(name):
    """A TraceMe context: an event named `name` in the running profile."""
    from tensorflow.python.profiler.internal import _pywrap_traceme  # pylint: disable=import-outside-toplevel
    return _TraceMe(_pywrap_traceme.TraceMe, name)


class _TraceMe:
    def __init__(self, factory, name):
        self._factory, self._name, self._active = factory, name, None

    def __enter__(self):
        self._active = self._factory(self._name)
        return self

    def __exit__(self, *exc):
        self._active.Stop()
        self._active = None


def profile_memory_events(raw):
    """(name, start, end, {stat: value}) of the marker and memory events of an exported
    profile (`*.xplane.pb`); times in picoseconds from the profile's start."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # pylint: disable=import-outside-toplevel
    space = xplane_pb2.XSpace.FromString(raw)
    events = []
    for plane in space.planes:
        stat_names = {key: value.name for key, value in plane.stat_metadata.items()}
        wanted = {key: value.name for key, value in plane.event_metadata.items()
                  if value.name.startswith(("Memory", "tfmem_"))}
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for event in line.events:
                name = wanted.get(event.metadata_id)
                if name is None:
                    continue
                stats = {}
                for stat in event.stats:
                    kind = stat.WhichOneof("value")
                    value = getattr(stat, kind) if kind else None
                    if kind == "ref_value":
                        value = stat_names.get(value)
                    stats[stat_names.get(stat.metadata_id, "")] = value
                start = base + event.offset_ps
                events.append((name, start, start + event.duration_ps, stats))
    return events


# Grappler -------------------------------------------------------------------

def grappler_optimize(config_proto, meta_graph):
    """The GraphDef Grappler's meta optimizer makes of `meta_graph` under `config_proto`."""
    from tensorflow.python.grappler import tf_optimizer  # pylint: disable=import-outside-toplevel
    return tf_optimizer.OptimizeGraph(config_proto, meta_graph)
