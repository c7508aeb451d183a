"""Prefetch: a background thread that uploads host buffers back to the device.

An upload is one small Session call: feed the host buffers, copy them into
the device's allocator, and keep them there (the residence builds those ops:
session handles, or staging areas on a distributed session).  Running it on
a thread while the main thread runs an earlier partition overlaps the
transfer with compute (TensorFlow sessions accept concurrent calls).
"""

import concurrent.futures

from tfmem import tf_private


class Prefetcher:
    """Runs upload callables on one thread; returns Futures of their tickets."""

    def __init__(self, session):
        self._session = session
        self._batches = {}  # serialized CallableOptions -> raw callable
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tfmem-prefetch")

    def batch(self, options):
        """The callable of an upload (CallableOptions from a residence), made once.

        Call it after every op of the plan exists: a callable made after new
        ops extends the session's graph, which copies the whole graph.
        """
        key = options.SerializeToString(deterministic=True)
        if key not in self._batches:
            self._batches[key] = tf_private.make_callable(self._session, options)
        return self._batches[key]

    def upload(self, batch, arrays):
        """A Future of the tickets of the arrays' copies on the device."""
        return self._thread.submit(batch, *arrays)

    def close(self):
        self._thread.shutdown(wait=True)
