"""Partitions run through `Session.run`'s C path (TF_SessionRun), so steps share executors.

A session callable bakes its RunOptions in: a step measured with allocation
tracking (see sampling) and an untraced step would need two callables, and
TensorFlow builds each callable's executors anew (prune, place, Grappler over
the whole session graph).  `Session.run` keys its executors by the names it
feeds, fetches and runs alone and takes the RunOptions per call, so every step
of a partition, traced or not, runs on the executors its first call built:

    measured step  --SOFTWARE_TRACE-->  TF_SessionRun(names)  --> executors (built once)
    untraced step  --no trace------->  TF_SessionRun(names)  -->   the same executors

It costs a few microseconds more per call than a callable (names joined into
TensorFlow's cache key).  Options.calls_by_name turns it on (off by default:
see its docstring).  It is also how a distributed session returns a step's run
metadata (its `RunCallable` drops the master's).  A partition whose
originals read connected tensors (`CallableOptions.tensor_connection`, see
rewrite) cannot run this way: it stays a callable per run options.
"""

from tensorflow.python.client import pywrap_tf_session as tf_c
from tensorflow.python.util import compat

from tfmem import tf_private


def wants_run_path(session, run_metadata):
    """True when a callable would lose the step's run metadata (a distributed session)."""
    return run_metadata is not None and bool(session.sess_str)


class RunPath:
    """One partition's call by name: its feeds, fetches and targets resolved once.

    `built` says whether a call of it has returned: a call that starts before then
    makes TensorFlow build the executors (calls racing on first use each build them,
    as they would through plain `Session.run`); `calling(options)` is what a step
    calls with its run options."""

    def __init__(self, session, program):
        graph = session.graph
        self._session = session
        self._feeds = [tf_private.tf_output(graph.get_tensor_by_name(name))
                       for name in program.feeds]
        self._fetches = [tf_private.tf_output(graph.get_tensor_by_name(name))
                         for name in program.fetches]
        self._targets = [tf_private.c_op(graph.get_operation_by_name(name))
                         for name in program.targets]
        self.built = False

    def calling(self, run_options):
        """A RunPathCallable of this partition with these RunOptions (None: defaults)."""
        return RunPathCallable(self, run_options.SerializeToString()
                               if run_options is not None else None)

    def run(self, feed_values, options, run_metadata):
        """TF_SessionRun with serialized RunOptions `options` (or None); fills
        `run_metadata` (a RunMetadata, or None)."""
        options = tf_c.TF_NewBufferFromString(compat.as_bytes(options)) if options else None
        metadata = tf_c.TF_NewBuffer() if run_metadata is not None else None
        try:
            values = tf_private.session_run(
                self._session, options, dict(zip(self._feeds, feed_values)), self._fetches,
                self._targets, metadata)
            self.built = True
            if metadata is not None:
                run_metadata.ParseFromString(compat.as_bytes(tf_c.TF_GetBuffer(metadata)))
            return values
        finally:
            if metadata is not None:
                tf_c.TF_DeleteBuffer(metadata)
            if options is not None:
                tf_c.TF_DeleteBuffer(options)


class RunPathCallable:
    """Called like a raw session callable: `call(*feed_values, run_metadata=None)`."""

    def __init__(self, path, options):
        self.path = path
        self._options = options  # serialized RunOptions, or None

    def __call__(self, *feed_values, run_metadata=None):
        return self.path.run(feed_values, self._options, run_metadata)
