"""Prefetch: a background thread that uploads host buffers back to the device.

An upload is one small Session call: feed the host buffer, copy it into the
device's allocator, and keep it there as a session handle.  Running it on a
thread while the main thread runs an earlier partition overlaps the
transfer with compute (TensorFlow sessions accept concurrent calls).  On a
CPU "device" the fed buffer would be used in place, so a DeepCopy makes the
upload a real allocation, as it is on a GPU.
"""

import concurrent.futures

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem.rewrite import clean_context


class Prefetcher:
    """Uploads numpy arrays to device-resident session handles on one thread."""

    def __init__(self, session, device):
        self._session = session
        self._device = device  # "GPU:0", or "CPU:0" on an emulated accelerator
        self._options = {}  # tuple of dtypes -> CallableOptions of its upload
        self._batches = {}  # tuple of dtypes -> raw callable, made on first use
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tfmem-prefetch")

    def add_batch(self, dtypes):
        """Add the ops of an upload of arrays of these dtypes in one Session call.

        Call it from the main thread when compiling a plan, not while a step runs,
        and before making any callable of the plan: each first callable after new
        ops extends the session's graph, which copies the whole graph.
        """
        dtypes = tuple(dtypes)
        if dtypes not in self._options:
            graph = self._session.graph
            feeds, fetches = [], []
            with clean_context(graph), graph.name_scope("tfmem/upload/"), \
                    graph.device("/device:" + self._device):
                for dtype in dtypes:
                    host = tf.compat.v1.placeholder(dtype, None, name="host")
                    on_device = (tf.raw_ops.DeepCopy(x=host) if self._device.startswith("CPU")
                                 else tf.identity(host))
                    feeds.append(host.name)
                    fetches.append(tf.raw_ops.GetSessionHandle(value=on_device).name)
            self._options[dtypes] = config_pb2.CallableOptions(feed=feeds, fetch=fetches)

    def batch(self, dtypes):
        """The callable of an upload added by `add_batch`."""
        dtypes = tuple(dtypes)
        if dtypes not in self._batches:
            self._batches[dtypes] = self._session._make_callable_from_options(  # pylint: disable=protected-access
                self._options[dtypes])
        return self._batches[dtypes]

    def upload(self, batch, arrays):
        """A Future of the handles of the arrays' copies on the device."""
        return self._thread.submit(batch, *arrays)

    def close(self):
        self._thread.shutdown(wait=True)
