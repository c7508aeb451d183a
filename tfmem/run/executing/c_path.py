"""A partition run through `Session.run`'s C path instead of a session callable.

Session callables are tfmem's fast path, but TensorFlow's distributed
session drops the run metadata of a callable (`GrpcSession::RunCallable`
never copies the master's metadata into the caller's), while its ordinary
run returns it.  So on a distributed session, a step that asks for
`run_metadata` runs each partition this way: the same feeds, fetches,
targets and run options as the callable, through `TF_SessionRun`.

A local session whose steps are sampled (`Options.measure="sample"`) runs
every step this way: DirectSession keys `Session.run`'s executors by feeds,
fetches and targets, not by run options, so measured steps (traced) and the
others share one executor per partition, where a callable bakes its run
options in and each kind would build its own.  A call costs a few
microseconds more than a callable's.

DirectSession builds such an executor at its first run; a plan builds them
when it is compiled instead (`RunPathCallable.build`), as it makes callables:
built in the plan's first step, each partition's constants (Grappler's folded
ones: the 1 MiB gradient of a mean over a [1024, 256] tensor) would be
allocated in the middle of the step, beside the step's tensors, where the
prediction does not expect them (2-3 MiB over a partition's peak with
callables in docs/api.md's 24 MiB example, which then ran out of memory in
one run of five).

DirectSession keeps those executors until the session closes, and with them
what their kernels hold: a Const kernel keeps its tensor, which a variable
assigned from it shares (see memory/first_updates).  An initializing request
therefore runs callables, whose release frees those constants after its
first step (4 MiB for the 16 initial weights of docs/api.md's 24 MiB
example: kept, its budget-mode step runs out of memory).  A plan replaced by
a re-plan leaves its executors in the session too: their kernels' constants
(Grappler's folded ones included: 1.75 MiB in that example, about 10 KiB for
a 60-layer ResNet), which budget mode reads as held by the device, and their
graphs in host memory.
"""

import functools

import numpy as np
import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as tf_c
from tensorflow.python.util import compat

from tfmem import tf_private


def wants_run_path(session, run_metadata):
    """True when a callable would lose the step's run metadata."""
    return run_metadata is not None and bool(session.sess_str)


def shares_executors(session, measure, measure_device, released):
    """True when every step of a plan runs this way, so that its measured and
    unmeasured steps share executors: steps sampled on a local session, for a plan
    whose executor is kept (`released`: freed after its first step, see above)."""
    return measure == "sample" and measure_device and not session.sess_str and not released


class RunPathCallable:
    """Called like a raw session callable: `call(*feed_values, run_metadata=None)`."""

    def __init__(self, session, callable_options):
        graph = session.graph
        self._session = session
        self._feed_names = list(callable_options.feed)
        self._feeds = [tf_private.tf_output(graph.get_tensor_by_name(name))
                       for name in callable_options.feed]
        self._fetches = [tf_private.tf_output(graph.get_tensor_by_name(name))
                         for name in callable_options.fetch]
        self._targets = [tf_private.c_op(graph.get_operation_by_name(name))
                         for name in callable_options.target]
        self._options = (callable_options.run_options.SerializeToString()
                         if callable_options.HasField("run_options") else None)
        # DirectSession's key of the executor a call runs (its first call builds it)
        self.signature = tuple(tuple(sorted(names)) for names in (
            callable_options.feed, callable_options.fetch, callable_options.target))

    def build(self):
        """Have DirectSession build this call's executor now, running nothing; False
        where it cannot (no feeds, see `_mistyped_feeds_run_nothing`): its first call
        builds it."""
        if not self._feeds or not _mistyped_feeds_run_nothing():
            return False
        graph = self._session.graph
        mistyped = {output: _mistyped(graph.get_tensor_by_name(name).dtype)
                    for output, name in zip(self._feeds, self._feed_names)}
        try:
            tf_private.session_run(self._session, None, mistyped, self._fetches,
                                   self._targets, None)
        except tf.errors.InvalidArgumentError:
            return True
        raise AssertionError("a call fed mistyped values ran")  # the probe says it cannot

    def __call__(self, *feed_values, run_metadata=None):
        options = tf_c.TF_NewBufferFromString(compat.as_bytes(self._options)) if self._options else None
        metadata = tf_c.TF_NewBuffer() if run_metadata is not None else None
        try:
            values = tf_private.session_run(
                self._session, options, dict(zip(self._feeds, feed_values)), self._fetches,
                self._targets, metadata)
            if metadata is not None:
                run_metadata.ParseFromString(compat.as_bytes(tf_c.TF_GetBuffer(metadata)))
            return values
        finally:
            if metadata is not None:
                tf_c.TF_DeleteBuffer(metadata)
            if options is not None:
                tf_c.TF_DeleteBuffer(options)


def _mistyped(dtype):
    """A scalar no feed of `dtype` accepts."""
    return np.zeros((), np.int32 if dtype == tf.bool else np.bool_)


@functools.lru_cache(maxsize=None)
def _mistyped_feeds_run_nothing():
    """Whether a run fed values of the wrong dtypes builds and keeps its executor and
    then fails before any op runs: DirectSession::Run builds the executor
    (GetOrCreateExecutors), then checks the fed dtypes (FunctionCallFrame::SetArgs).
    Checked once per process on a graph of its own, whose unfed stateful op must not
    have run, so that a TensorFlow checking in another order builds nothing ahead."""
    graph = tf.Graph()
    with graph.as_default():
        fed = tf.compat.v1.placeholder(tf.float32, [])
        counter = tf.compat.v1.get_variable("counter", [], tf.int32, use_resource=True,
                                            initializer=tf.compat.v1.zeros_initializer())
        count = counter.assign_add(1, read_value=False)
        doubled = fed * 2.0
    # a session of its own on the CPU, with threads of its own (no process-wide pool made)
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0}, use_per_session_threads=True,
                                      inter_op_parallelism_threads=1,
                                      intra_op_parallelism_threads=1)
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(counter.initializer)
        try:
            tf_private.session_run(session, None, {tf_private.tf_output(fed): _mistyped(fed.dtype)},
                                   [tf_private.tf_output(doubled)], [tf_private.c_op(count)],
                                   None)
        except tf.errors.InvalidArgumentError:
            pass
        return int(session.run(counter.read_value())) == 0
