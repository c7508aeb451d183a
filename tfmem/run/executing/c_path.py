"""A partition run through `Session.run`'s C path instead of a session callable.

Session callables are tfmem's fast path, but TensorFlow's distributed
session drops the run metadata of a callable (`GrpcSession::RunCallable`
never copies the master's metadata into the caller's), while its ordinary
run returns it.  So on a distributed session, a step that asks for
`run_metadata` runs each partition this way: the same feeds, fetches,
targets and run options as the callable, through `TF_SessionRun`.
"""

from tensorflow.python.client import pywrap_tf_session as tf_c
from tensorflow.python.util import compat

from tfmem import tf_private


def wants_run_path(session, run_metadata):
    """True when a callable would lose the step's run metadata."""
    return run_metadata is not None and bool(session.sess_str)


class RunPathCallable:
    """Called like a raw session callable: `call(*feed_values, run_metadata=None)`."""

    def __init__(self, session, callable_options):
        graph = session.graph
        self._session = session
        self._feeds = [tf_private.tf_output(graph.get_tensor_by_name(name))
                       for name in callable_options.feed]
        self._fetches = [tf_private.tf_output(graph.get_tensor_by_name(name))
                         for name in callable_options.fetch]
        self._targets = [tf_private.c_op(graph.get_operation_by_name(name))
                         for name in callable_options.target]
        self._options = (callable_options.run_options.SerializeToString()
                         if callable_options.HasField("run_options") else None)

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
