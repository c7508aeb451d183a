"""Monitored sessions whose every `run` goes through tfmem.

`MonitoredSession` builds its session through a *session creator*
(`ChiefSessionCreator`, `WorkerSessionCreator`), then starts queue runners,
calls the hooks' `after_create_session` and runs every step, hooks' extra
fetches included, through that session.  So tfmem only has to wrap what the
creator returns:

    sess = tf.compat.v1.train.MonitoredSession(
        session_creator=tfmem.SessionCreator(ChiefSessionCreator(...), partition_size=50),
        hooks=hooks)

Initialisation and the restore from a checkpoint run inside the inner creator,
on the plain session, before tfmem sees it; all steps and hooks run
partitioned.  On a preemption error (`AbortedError`, `UnavailableError`)
`MonitoredSession` closes the session and asks the creator again: the
recovered worker restores the last checkpoint and is wrapped again.

`MonitoredTrainingSession`, `SingularMonitoredSession` and `MonitoredSession`
without a creator build their creators themselves; the functions of the same
names here call TensorFlow's with those creators wrapped, taking tfmem's
options as extra keyword arguments:

    with tfmem.MonitoredTrainingSession(partition_size=50, checkpoint_dir=d,
                                        hooks=hooks) as sess:

The graph is finalized by then; tfmem adds its partition copies anyway (see
graph_growth).
"""

import contextlib
import threading

from tensorflow.python.training import monitored_session as tf_monitored

from tfmem.run.front_end import options as run_options
from tfmem.run.front_end.session import TFMemSession

# The keyword arguments of TFMemSession besides the session itself, and the Options
# fields these took as keywords before (deprecated spellings).
OLD_KEYWORDS = ("swap_min_bytes", "place_state_on_host")
TFMEM_OPTIONS = run_options.EVERYDAY + ("options",) + OLD_KEYWORDS


class SessionCreator(tf_monitored.SessionCreator):
    """A session creator whose sessions are `TFMemSession`s around another creator's."""

    def __init__(self, session_creator=None, **tfmem_options):
        unknown = set(tfmem_options) - set(TFMEM_OPTIONS)
        if unknown:
            raise TypeError(f"unknown tfmem options {sorted(unknown)}; "
                            f"the options are {', '.join(TFMEM_OPTIONS)}")
        self._inner = session_creator or tf_monitored.ChiefSessionCreator()
        deprecated = {k: tfmem_options.pop(k) for k in OLD_KEYWORDS if k in tfmem_options}
        tfmem_options["options"] = run_options.resolve(
            tfmem_options.get("options"), deprecated, run_options.SESSION,
            caller="tfmem.SessionCreator")
        self._options = tfmem_options

    @property
    def inner(self):
        """The wrapped session creator."""
        return self._inner

    def create_session(self):
        return TFMemSession(self._inner.create_session(), **self._options)


def split_options(kwargs):
    """(tfmem options, the other keyword arguments)."""
    ours = {k: v for k, v in kwargs.items() if k in TFMEM_OPTIONS}
    return ours, {k: v for k, v in kwargs.items() if k not in TFMEM_OPTIONS}


_PATCHING = threading.Lock()


@contextlib.contextmanager
def _creators_wrapped(options):
    """While TensorFlow builds a monitored session on this thread, the creators
    it makes for itself are wrapped.  Other threads get TensorFlow's own."""
    owner = threading.get_ident()
    originals = {name: getattr(tf_monitored, name)
                 for name in ("ChiefSessionCreator", "WorkerSessionCreator")}

    def wrapping(original):
        def make(*args, **kwargs):
            creator = original(*args, **kwargs)
            if threading.get_ident() != owner:
                return creator
            return SessionCreator(creator, **options)
        return make

    with _PATCHING:
        for name, original in originals.items():
            setattr(tf_monitored, name, wrapping(original))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(tf_monitored, name, original)


def MonitoredTrainingSession(*args, **kwargs):  # pylint: disable=invalid-name
    """`tf.compat.v1.train.MonitoredTrainingSession`, every run through tfmem.

    Takes TensorFlow's arguments plus TFMemSession's keyword options."""
    options, kwargs = split_options(kwargs)
    with _creators_wrapped(options):
        return tf_monitored.MonitoredTrainingSession(*args, **kwargs)


def MonitoredSession(session_creator=None, hooks=None, **kwargs):  # pylint: disable=invalid-name
    """`tf.compat.v1.train.MonitoredSession`, every run through tfmem."""
    options, kwargs = split_options(kwargs)
    creator = SessionCreator(session_creator, **options)
    return tf_monitored.MonitoredSession(session_creator=creator, hooks=hooks, **kwargs)


def SingularMonitoredSession(*args, **kwargs):  # pylint: disable=invalid-name
    """`tf.compat.v1.train.SingularMonitoredSession`, every run through tfmem."""
    options, kwargs = split_options(kwargs)
    with _creators_wrapped(options):
        return tf_monitored.SingularMonitoredSession(*args, **kwargs)
