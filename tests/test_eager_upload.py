"""tfmem.function's uploads hold one copy of a swapped tensor on the device.

The prefetcher turns a pooled host buffer back into a device tensor.  On the
emulated accelerator (a CPU device under a capped allocator) converting the
array would already copy it into the allocator, and a further copy would hold the
bytes twice while it runs, which the memory model does not count; and where that
conversion finds no memory, TensorFlow crashes the process.  The upload must not
share the pooled buffer either: the pool hands it out again at once.

One fresh process per kernel path: the device holds its cap as one region, so a
chunk is its rounded request, and TensorFlow's own peak is read around one upload.
"""

import pytest

from conftest import run_worker
from tfmem.cli import child_env

MIB = 1 << 20

SCRIPT = r"""
import json
import ml_dtypes
import numpy as np
import tfmem
import tensorflow as tf
from tfmem.run.executing.buffers import aligned_bytes
from tfmem.run.placement import accelerator
from tfmem.tf2.transfers import EagerPrefetcher

tfmem.reserve_emulated_memory()
array = aligned_bytes(32 << 20).view(np.float32)
array[:] = 1.5
prefetcher = EagerPrefetcher("CPU:0")
resident = accelerator.device_memory("CPU:0")["current"]
accelerator.reset_peak("CPU:0")
uploaded = prefetcher.upload(prefetcher.batch, [array]).result()[0]
peak = accelerator.device_memory("CPU:0")["peak"]
array[:] = 7.0  # the pool reuses the buffer
values = uploaded.numpy()
# every dtype a swapped tensor may have comes back equal, from a buffer of the pool's
dtypes = {}
for dtype in [np.float16, ml_dtypes.bfloat16, np.float64, np.int8, np.uint16, np.int64,
              np.bool_, np.complex64]:
    host = aligned_bytes(6 * np.dtype(dtype).itemsize).view(dtype).reshape(2, 3)
    host[:] = np.arange(6).reshape(2, 3).astype(dtype)
    back = prefetcher.batch(host)[0]
    dtypes[np.dtype(dtype).name] = [back.dtype.name, bool(np.array_equal(back.numpy(), host))]
# an upload the device has no room for raises TensorFlow's out-of-memory error
del uploaded
filler = tf.fill([(256 - 40) << 18], 1.0)
array[:] = 2.0
try:
    prefetcher.upload(prefetcher.batch, [array]).result()
    full = "fitted"
except tf.errors.ResourceExhaustedError:
    full = "ResourceExhaustedError"
prefetcher.close()
print("TFMEM-RESULTS " + json.dumps(dict(
    rise=peak - resident, nbytes=array.nbytes, full=full, dtypes=dtypes,
    unchanged=bool(np.all(values == 1.5)), shape=list(values.shape))))
"""


@pytest.mark.parametrize("onednn", [False, True])
def test_an_upload_allocates_one_copy_that_does_not_share_the_pooled_buffer(onednn):
    figures = run_worker(SCRIPT, child_env.child_env(cap_mib=256, onednn=onednn), timeout=120)
    assert figures["shape"] == [(32 * MIB) // 4]
    assert figures["unchanged"], "the upload changed with the pooled host buffer"
    assert figures["nbytes"] <= figures["rise"] < 1.5 * figures["nbytes"], (
        f"one upload of {figures['nbytes'] / MIB:.0f} MiB raised the device's peak by "
        f"{figures['rise'] / MIB:.1f} MiB")
    assert figures["full"] == "ResourceExhaustedError"
    assert all(name == back and equal for name, (back, equal) in figures["dtypes"].items()), \
        figures["dtypes"]
