"""Swap manager: the transfers of one step, on the device or in host buffers.

The plan (see `swap`) says, for every transfer, which device copies exist
and when; the swap manager carries that out for one step:

* the producer's ticket (a session handle, a staging key: see residence)
  is kept while its span has readers;
* a swapped tensor is copied into a pooled host buffer right after its
  producer, and the fetched array is dropped so TensorFlow frees the device
  copy;
* uploads start on the prefetch thread at their span's start partition, and
  the first reader waits for the handle (the wait is timed);
* a span's last reader deletes the handle in-graph; the host buffer returns
  to the pool once its last upload is done.

If the step fails, `abort` waits for running uploads and has the residence
release every ticket the step still holds, and returns its host buffers.
"""

import time

import numpy as np

from tfmem.plan.schedule import Schedule  # noqa: F401  (the schedule a SwapManager follows)
from tfmem.run.measuring.stats import TransferCounts
from tfmem.run.measuring.trace import NO_TIMELINE


class SwapManager:
    """One step's transfers, following a Schedule.

    `batches[i]` is the prefetcher's upload callable for `schedule.uploads[i]`.
    """

    def __init__(self, schedule, batches, pool, prefetcher, releaser, timeline=None):
        """`releaser` has `release(tickets)`: the plan's residence."""
        self._schedule = schedule
        self._timeline = timeline or NO_TIMELINE
        self._batches = batches
        self._pool = pool
        self._prefetcher = prefetcher
        self._releaser = releaser
        self._handles = {}  # key -> (handle, nbytes)
        self._uploads = {}  # key -> (Future of the batch's handles, index in the batch)
        self._host = {}  # tensor -> host buffer
        self._uploads_left = dict(schedule.upload_count)
        self._live, self._live_bytes = 0, 0
        self.counts = TransferCounts()

    def _on_device(self, count, nbytes):
        self._live += count
        self._live_bytes += nbytes
        self.counts.on_device(self._live, self._live_bytes)

    def keep(self, tensor, handle):
        """The producer's device copy, read by the first span."""
        nbytes = self._schedule.nbytes[tensor]
        self._handles[self._schedule.kept[tensor]] = (handle, nbytes)
        self._on_device(1, nbytes)

    def swap_out(self, tensor, value):
        """Copy a fetched value into a host buffer; dropping `value` frees the device copy."""
        started = time.perf_counter()
        buffer = self._pool.acquire(value.shape, value.dtype)
        np.copyto(buffer, value)
        self._host[tensor] = buffer
        self._timeline.span("swap-out", tensor, started, {"bytes": buffer.nbytes})
        self.counts.swapped_out += 1
        self.counts.swapped_out_bytes += buffer.nbytes

    def start_uploads(self, index):
        """Submit, as one batch, the uploads whose span starts at partition `index`."""
        keys = self._schedule.uploads[index]
        if keys:
            arrays = [self._host[tensor] for tensor, _ in keys]
            batch = self._batches[index]
            batch = self._timed(batch, index, keys, sum(a.nbytes for a in arrays))
            future = self._prefetcher.upload(batch, arrays)
            for position, key in enumerate(keys):
                self._uploads[key] = (future, position)
            self._on_device(len(keys), sum(a.nbytes for a in arrays))

    def _timed(self, batch, index, keys, nbytes):
        """The upload call, counted (StepStats.uploads, upload_time) and traced; it runs
        on the prefetch thread, the only writer of those two counters."""
        def upload(*arrays):
            started = time.perf_counter()
            handles = batch(*arrays)
            self.counts.upload_time += time.perf_counter() - started
            self.counts.uploads += 1
            self._timeline.span("prefetch", f"upload for partition {index}", started,
                                {"tensors": [t for t, _ in keys], "bytes": nbytes})
            return handles
        return upload

    def handle_for(self, tensor, index):
        """The device handle partition `index` feeds for `tensor`, waiting for its upload."""
        key = self._schedule.reads[index][tensor]
        if key in self._uploads:
            future, position = self._uploads.pop(key)
            started = time.perf_counter()
            handle = future.result()[position]
            self.counts.prefetch_wait_time += time.perf_counter() - started
            self._timeline.span("wait", tensor, started)
            buffer = self._host[tensor]
            self._handles[key] = (handle, buffer.nbytes)
            self.counts.swapped_in += 1
            self.counts.swapped_in_bytes += buffer.nbytes
            self._uploads_left[tensor] -= 1
            if self._uploads_left[tensor] == 0:
                self._pool.release(self._host.pop(tensor))
        return self._handles[key][0]

    def finish(self, index):
        """Forget the handles partition `index` deleted in-graph."""
        for key in self._schedule.frees[index]:
            _, nbytes = self._handles.pop(key)
            self._on_device(-1, -nbytes)

    def abort(self):
        """Release every handle and buffer of a step that did not finish."""
        handles = [h for h, _ in self._handles.values()]
        for future, position in self._uploads.values():
            try:
                handles.append(future.result()[position])
            except Exception:  # pylint: disable=broad-except
                pass  # the upload failed: it holds nothing
        self._releaser.release(handles)
        for buffer in self._host.values():
            self._pool.release(buffer)
        self._handles.clear()
        self._uploads.clear()
        self._host.clear()
