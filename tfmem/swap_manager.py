"""Swap manager: the transfers of one step, on the device or in host buffers.

The plan (see `swap`) says, for every transfer, which device copies exist
and when; the swap manager carries that out for one step:

* the producer's handle is kept while its span has readers;
* a swapped tensor is copied into a pooled host buffer right after its
  producer, and the fetched array is dropped so TensorFlow frees the device
  copy;
* uploads start on the prefetch thread at their span's start partition, and
  the first reader waits for the handle (the wait is timed);
* a span's last reader deletes the handle in-graph; the host buffer returns
  to the pool once its last upload is done.

If the step fails, `abort` waits for running uploads and releases every
handle and buffer the step still holds.
"""

import time

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem.rewrite import clean_context


class HandleReleaser:
    """Deletes session handles outside a plan, for steps that did not finish."""

    def __init__(self, session):
        self._session = session
        self._delete = None

    def release(self, handles):
        if not handles:
            return
        if self._delete is None:
            graph = self._session.graph
            with clean_context(graph), graph.name_scope("tfmem/release/"):
                holder = tf.compat.v1.placeholder(tf.string, [], name="handle")
                op = tf.raw_ops.DeleteSessionTensor(handle=holder)
            self._delete = self._session._make_callable_from_options(  # pylint: disable=protected-access
                config_pb2.CallableOptions(feed=[holder.name], target=[op.name]))
        for handle in handles:
            try:
                self._delete(handle)
            except tf.errors.OpError:
                pass  # already deleted in-graph by the partition that failed


class SwapManager:
    """One step's transfers; keyed by (tensor, first reader of the span)."""

    def __init__(self, plan, pool, prefetcher, releaser):
        self._plan = plan
        self._transfers = {t.tensor: t for t in plan.transfers}
        self._pool = pool
        self._prefetcher = prefetcher
        self._releaser = releaser
        self._handles = {}  # key -> (handle, nbytes)
        self._uploads = {}  # key -> Future of a handle
        self._host = {}  # tensor -> host buffer
        self._uploads_left = {t.tensor: sum(s.uploaded for s in t.spans) for t in plan.transfers}
        self.counts = dict(swapped_out=0, swapped_out_bytes=0, swapped_in=0, swapped_in_bytes=0,
                           peak_device_handles=0, peak_device_handle_bytes=0,
                           prefetch_wait_time=0.0)

    def _track_peak(self):
        live = list(self._handles.values())
        self.counts["peak_device_handles"] = max(self.counts["peak_device_handles"],
                                                 len(live) + len(self._uploads))
        live_bytes = sum(n for _, n in live) + sum(
            self._host[k[0]].nbytes for k in self._uploads if k[0] in self._host)
        self.counts["peak_device_handle_bytes"] = max(
            self.counts["peak_device_handle_bytes"], live_bytes)

    def keep(self, tensor, handle):
        """The producer's device copy, read by the first span."""
        transfer = self._transfers[tensor]
        nbytes = self._plan.view.tensor(tensor).nbytes or 0
        self._handles[(tensor, transfer.spans[0].readers[0])] = (handle, nbytes)
        self._track_peak()

    def swap_out(self, tensor, value):
        """Copy a fetched value into a host buffer; dropping `value` frees the device copy."""
        buffer = self._pool.acquire(value.shape, value.dtype)
        np.copyto(buffer, value)
        self._host[tensor] = buffer
        self.counts["swapped_out"] += 1
        self.counts["swapped_out_bytes"] += buffer.nbytes

    def start_uploads(self, partition):
        """Submit the uploads whose span starts at this partition."""
        for tensor in partition.uploads:
            transfer = self._transfers[tensor]
            dtype = self._plan.view.tensor(tensor).dtype
            for span in transfer.spans:
                if span.uploaded and span.start == partition.index:
                    key = (tensor, span.readers[0])
                    self._uploads[key] = self._prefetcher.upload(dtype, self._host[tensor])
        self._track_peak()

    def handle_for(self, tensor, reader):
        """The device handle `reader` feeds for `tensor`, waiting for its upload if needed."""
        key = (tensor, self._transfers[tensor].span_of(reader).readers[0])
        if key in self._uploads:
            future = self._uploads[key]
            started = time.perf_counter()
            handle = future.result()
            self.counts["prefetch_wait_time"] += time.perf_counter() - started
            del self._uploads[key]
            buffer = self._host[tensor]
            self._handles[key] = (handle, buffer.nbytes)
            self.counts["swapped_in"] += 1
            self.counts["swapped_in_bytes"] += buffer.nbytes
            self._uploads_left[tensor] -= 1
            if self._uploads_left[tensor] == 0:
                self._pool.release(self._host.pop(tensor))
        return self._handles[key][0]

    def finish(self, partition):
        """Forget the handles the partition deleted in-graph."""
        for tensor in partition.inputs:
            transfer = self._transfers[tensor]
            if transfer.frees_at(partition.index):
                del self._handles[(tensor, transfer.span_of(partition.index).readers[0])]

    def abort(self):
        """Release every handle and buffer of a step that did not finish."""
        handles = [h for h, _ in self._handles.values()]
        for future in self._uploads.values():
            try:
                handles.append(future.result())
            except Exception:  # pylint: disable=broad-except
                pass  # the upload failed: it holds nothing
        self._releaser.release(handles)
        for buffer in self._host.values():
            self._pool.release(buffer)
        self._handles.clear()
        self._uploads.clear()
        self._host.clear()
