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
* uploaded: on a background thread, one copy of the host buffer in the memory
  device's allocator, so that the pooled buffer may be reused at once.  On a GPU
  that is the host-to-device copy of the converted array.  On a CPU "device"
  (the emulated accelerator) it is a `DeepCopy` of a tensor that views the
  buffer (DLPack): converting the array instead (`tf.convert_to_tensor`) would
  copy it into the capped allocator too, holding the bytes twice while the
  upload runs, and where that copy finds no memory TensorFlow 2.21 crashes the
  process (SIGSEGV) instead of raising; a kernel's copy raises
  `ResourceExhaustedError`, which budget mode learns from.
"""

import concurrent.futures

import tensorflow as tf


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
            if self._on_cpu:
                return [tf.raw_ops.DeepCopy(x=_viewing(array)) for array in arrays]
            return [tf.identity(tf.convert_to_tensor(array)) for array in arrays]

    def upload(self, batch, arrays):
        """A Future of `batch(*arrays)`, run on the prefetch thread."""
        return self._thread.submit(batch, *arrays)

    def close(self):
        self._thread.shutdown(wait=True)


def _viewing(array):
    """An EagerTensor on `array`'s own memory, by DLPack; a converted copy for what DLPack
    cannot carry (a dtype numpy or TensorFlow does not export that way)."""
    try:
        return tf.experimental.dlpack.from_dlpack(array.__dlpack__())
    except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError):
        return tf.convert_to_tensor(array)
