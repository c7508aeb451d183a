"""How tensors cross partitions in eager mode: kept EagerTensors, host copies, uploads.

The shared SwapManager (`tfmem.run.executing.swap_manager`) decides *when* a tensor is
kept, copied out or uploaded; this module supplies *how* for eager
TensorFlow, with the interface the Session front end's prefetcher and
handle releaser offer:

* kept on the device: the partition's output EagerTensor itself is the
  "handle"; dropping the last reference frees it, so there is nothing to
  release explicitly (`DroppedHandles`);
* swapped: the SwapManager copies the value into a pooled host buffer, and
  the executor drops the EagerTensor;
* uploaded: on a background thread, one copy of the host buffer in the
  memory device's allocator, so the pooled buffer may be reused at once.  On
  a GPU that is the host-to-device copy.  On a CPU "device" (the emulated
  accelerator) `convert_to_tensor` already copies the array into the
  allocator (TensorFlow 2.21), and that tensor is the upload: a `DeepCopy` of
  it would hold the bytes twice while it runs, which the memory model does
  not count.  Only where the converted tensor would share the array's memory
  (`conversion_shares_memory`) is it copied.
"""

import concurrent.futures
import functools

import numpy as np
import tensorflow as tf

from tfmem.run.executing.buffers import aligned_bytes


class DroppedHandles:
    """The handle releaser of eager tensors: dropping the reference frees them."""

    def release(self, handles):
        del handles


class EagerPrefetcher:
    """Uploads host buffers to EagerTensors on `device`, on one background thread."""

    def __init__(self, device):
        self._device = "/device:" + device
        self._on_cpu = device.startswith("CPU")
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tfmem-eager-prefetch")

    def batch(self, *arrays):
        """EagerTensors on the device holding copies of `arrays` (one upload batch)."""
        with tf.device(self._device):
            return [self._copied(array) for array in arrays]

    def _copied(self, array):
        tensor = tf.convert_to_tensor(array)
        if not self._on_cpu:
            return tf.identity(tensor)  # the host-to-device copy
        if conversion_shares_memory(array.dtype):
            return tf.raw_ops.DeepCopy(x=tensor)
        return tensor

    def upload(self, batch, arrays):
        """A Future of `batch(*arrays)`, run on the prefetch thread."""
        return self._thread.submit(batch, *arrays)

    def close(self):
        self._thread.shutdown(wait=True)


@functools.lru_cache(maxsize=None)
def conversion_shares_memory(dtype):
    """Whether `tf.convert_to_tensor` of an aligned array of `dtype` (as the host buffer
    pool hands out) uses the array's memory rather than a copy: probed once per dtype
    on a small array, whose later change shows in a tensor that shares it."""
    probe = aligned_bytes(4096)
    probe[:] = 0
    tensor = tf.convert_to_tensor(probe.view(dtype))
    probe[:] = 1
    return bool(np.any(tensor.numpy().view(np.uint8)))
