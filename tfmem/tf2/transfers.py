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
* uploaded: on a background thread, `DeepCopy` of the host buffer on the
  memory device.  An EagerTensor made from an aligned numpy array can share
  its memory, so on a CPU "device" (the emulated accelerator) the copy makes
  the upload a real allocation, as it is on a GPU, and the pooled buffer may
  be reused at once.
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
        self._copy = ((lambda x: tf.raw_ops.DeepCopy(x=x)) if device.startswith("CPU")
                      else tf.identity)
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tfmem-eager-prefetch")

    def batch(self, *arrays):
        """EagerTensors on the device holding copies of `arrays` (one upload batch)."""
        with tf.device(self._device):
            return [self._copy(tf.convert_to_tensor(array)) for array in arrays]

    def upload(self, batch, arrays):
        """A Future of `batch(*arrays)`, run on the prefetch thread."""
        return self._thread.submit(batch, *arrays)

    def close(self):
        self._thread.shutdown(wait=True)
