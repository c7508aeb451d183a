"""Adding tfmem's ops to a graph the program has finalized.

`MonitoredSession`, `Supervisor` and many training scripts call
`graph.finalize()` before the first step, so that a bug adding ops in the
training loop (the graph growing step after step) raises at once.  tfmem has
to add ops after that point: each new request (a hook fetching a summary
every 100 steps, a checkpoint save) is planned on first use and its
partitions are imported as copies.

So, only while tfmem adds its own ops, the graph is unfinalized and then
finalized again, under one process-wide lock.  Why this is safe:

* what finalize guards against, unbounded growth from user code, does not
  happen: tfmem adds ops once per distinct request (plans are cached) and
  once per session for its upload and release ops;
* TensorFlow itself does the same (`MonitoredSession.close` unfinalizes a
  graph it finalized), and a session extends a graph that grew after its
  first run under its own mutex, as for any unfinalized program;
* the lock serialises tfmem's additions across threads and sessions; the
  window in which another thread of the program could add an op without the
  error is the import of one plan's copies.
"""

import contextlib
import threading

from tfmem import tf_private

_LOCK = threading.RLock()


@contextlib.contextmanager
def additions_allowed(graph):
    """Let tfmem add ops to `graph` inside the block, finalized or not."""
    with _LOCK:
        was_finalized = graph.finalized
        if was_finalized:
            tf_private.unfinalize(graph)
        try:
            yield graph
        finally:
            if was_finalized:
                graph.finalize()
