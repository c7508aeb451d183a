"""What makes TFMemSession a session in every sense TensorFlow checks.

TensorFlow's helpers (`start_queue_runners`, `Saver.save/restore`,
`MonitoredSession`'s hooks) accept any `SessionInterface`; `Tensor.eval`
and `Operation.run` use the default session.  This base class gives the
wrapper that interface.  Which calls are partitioned and which go straight
to the wrapped session:

* partitioned (through `run`): `run`, `make_callable`, and everything
  TensorFlow does through them (`Tensor.eval` / `Operation.run` under
  `as_default()`, queue runners, savers, hooks);
* passed straight to the wrapped session: `partial_run_setup` /
  `partial_run` (one TensorFlow step spread over several calls cannot be
  cut into partitions), `list_devices`, `sess_str`.
"""

import contextlib

from tensorflow.python.client import session as tf_session
from tensorflow.python.framework import stack as tf_stack

from tfmem import tf_private


class SessionInterfaceMethods(tf_session.SessionInterface):
    """The `SessionInterface` of a wrapper whose `run` is partitioned.

    Subclasses provide `run`, `graph`, `close` and `_session` (the wrapped
    `tf.compat.v1.Session`).
    """

    _context = None  # the ExitStack of `with tfs:`

    @property
    def sess_str(self):
        """The wrapped session's target ('' for an in-process session)."""
        return self._session.sess_str

    def partial_run_setup(self, fetches, feeds=None):
        """Passed straight to the wrapped session (see the module docstring)."""
        return self._session.partial_run_setup(fetches, feeds)

    def partial_run(self, handle, fetches, feed_dict=None):
        """Passed straight to the wrapped session (see the module docstring)."""
        return self._session.partial_run(handle, fetches, feed_dict)

    def list_devices(self):
        return self._session.list_devices()

    def as_default(self):
        """Make this wrapper the default session: `Tensor.eval()` and
        `Operation.run()` then run through it (partitioned)."""
        return tf_stack.default_session(self)

    def make_callable(self, fetches, feed_list=None, accept_options=False):
        """A callable running `fetches` through `run` (partitioned), as
        `Session.make_callable` returns one."""
        if feed_list is None:
            # Session.make_callable checks the fetches now when nothing is fed.
            tf_private.fetch_handler(self.graph, fetches, {})
            if accept_options:
                return lambda options=None, run_metadata=None: self.run(
                    fetches, options=options, run_metadata=run_metadata)
            return lambda: self.run(fetches)
        if not isinstance(feed_list, (list, tuple)):
            raise TypeError("Argument `feed_list` must be a list or tuple. "
                            f"Received: feed_list={feed_list}")
        feed_list = list(feed_list)

        def run_step(*feed_args, **kwargs):
            return self.run(fetches, feed_dict=dict(zip(feed_list, feed_args)), **kwargs)

        return run_step

    def __enter__(self):
        """As `Session.__enter__`: this wrapper and its graph become the defaults."""
        if self._context is not None:
            raise RuntimeError("Session context managers are not re-entrant. "
                               "Use `as_default()` if you want to enter a session multiple times.")
        context = contextlib.ExitStack()
        context.enter_context(self.graph.as_default())
        context.enter_context(self.as_default())
        self._context = context
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        """As `Session.__exit__`: leave the defaults, then close."""
        context, self._context = self._context, None
        try:
            if context is not None:
                context.__exit__(exc_type, exc_value, traceback)
        finally:
            self.close()
