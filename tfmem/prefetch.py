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
        self._uploads = {}  # dtype -> raw callable
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tfmem-prefetch")

    def prepare(self, dtypes):
        """Add the upload ops for these dtypes (main thread, before any step runs)."""
        graph = self._session.graph
        for dtype in dtypes:
            if dtype in self._uploads:
                continue
            with clean_context(graph), graph.name_scope(f"tfmem/upload_{dtype.name}/"), \
                    graph.device("/device:" + self._device):
                host = tf.compat.v1.placeholder(dtype, None, name="host")
                on_device = (tf.raw_ops.DeepCopy(x=host) if self._device.startswith("CPU")
                             else tf.identity(host))
                handle = tf.raw_ops.GetSessionHandle(value=on_device)
            self._uploads[dtype] = self._session._make_callable_from_options(  # pylint: disable=protected-access
                config_pb2.CallableOptions(feed=[host.name], fetch=[handle.name]))

    def upload(self, dtype, array):
        """A Future of the session handle of `array`'s copy on the device."""
        return self._thread.submit(lambda: self._uploads[dtype](array)[0])

    def close(self):
        self._thread.shutdown(wait=True)
