"""Execute: run a rewritten plan, one Session call per partition.

The loop is deliberately thin.  Each partition is a raw session callable
(`Session.make_callable`'s C++ path without its Python fetch handling, which
would wrap fetched handles in objects that free themselves later); its feeds
are the request's fed values and the transfers it reads, its fetches are
the transfers it produces and the requested tensors it computes.  A transfer
lives in `store` from its producer to its last reader, which deletes a
device handle in-graph.  If a step fails, every handle it still holds is
released before the error propagates.
"""

import logging

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2

from tfmem.plan import Residency
from tfmem.rewrite import clean_context

log = logging.getLogger(__name__)


def _callable_options(program, run_options):
    options = config_pb2.CallableOptions(feed=program.feeds, fetch=program.fetches,
                                         target=program.targets)
    if run_options is not None:
        options.run_options.CopyFrom(run_options)
    return options


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
                pass  # already deleted by the partition that failed


class Executor:
    """Runs the programs of one plan on one session."""

    def __init__(self, session, plan, programs, releaser):
        self._session = session
        self._plan = plan
        self._programs = programs
        self._releaser = releaser
        self._device_transfers = {t.tensor for t in plan.transfers
                                  if t.residency is Residency.DEVICE}
        self._callables = {}  # serialized RunOptions -> list of callables

    def _callables_for(self, options):
        key = options.SerializeToString(deterministic=True) if options is not None else b""
        if key not in self._callables:
            make = self._session._make_callable_from_options  # pylint: disable=protected-access
            self._callables[key] = [make(_callable_options(p, options)) for p in self._programs]
        return self._callables[key]

    def run(self, feeds, options=None, run_metadata=None):
        """Run one step; return {requested tensor name: value}."""
        callables = self._callables_for(options)
        store, results = {}, {}
        try:
            for program, call in zip(self._programs, callables):
                args = [feeds[s] if s in feeds else store[s] for s in program.feed_sources]
                if run_metadata is not None:
                    metadata = config_pb2.RunMetadata()
                    values = call(*args, run_metadata=metadata)
                    run_metadata.MergeFrom(metadata)
                else:
                    values = call(*args)
                for (is_transfer, name), value in zip(program.fetch_sinks, values):
                    (store if is_transfer else results)[name] = value
                for name in program.releases:
                    del store[name]
        except BaseException:
            self._releaser.release([v for k, v in store.items() if k in self._device_transfers])
            raise
        return results
