"""A step as one DirectSession partial run: one executor per request, not per partition.

Every Session callable is built from the whole session graph (a copy and a
prune of it), so a plan of n partitions costs n times the graph's size
before its first step.  `partial_run_setup` builds one executor for all
partitions of the plan (its copies from `prun_import`), which DirectSession
caches by the feed and fetch names, so later steps only start it again.
A step is then:

    setup                   start the executor (every partition's gate still closed)
    call k, for each k      feed gate k, the feeds k reads first, the tickets of its
                            uploaded transfers; fetch its swapped outputs, results and
                            its done token (returns when all of partition k has run)

The last call consumes every feed and fetch, and TensorFlow ends the partial
run.  A call that fails ends it too (DirectSession drops a partial run whose
call failed).  A step that stops early in Python (Ctrl-C between partitions,
an error in tfmem) feeds the cancel flag: the executor fails on purpose,
runs nothing more, and TensorFlow drops it.

A partial run takes no RunOptions and returns no RunMetadata, so steps with
`options`, `run_metadata` or measured device peaks run the callables (see
execute).  The C API is called directly: Python's `Session.partial_run`
rebuilds its fetch handler on every call.
"""

import copy
import logging
import time

import numpy as np
from tensorflow.python.client import pywrap_tf_session as tf_c
import tensorflow as tf

from tfmem.run import plan_import, prun_import
from tfmem.run.step_loop import Wiring
from tfmem import tf_private

log = logging.getLogger(__name__)

ENABLED = True  # False: every plan runs its callables (tools/bench.py --callables compares)

_OPEN = np.asarray(0, np.int32)
_STOP = np.asarray(True)
_GO = np.asarray(False)


def wiring(program):
    """The step loop's Wiring of a partial-run call (the gate is fed by the call itself)."""
    return Wiring(program.feed_sources, program.fetch_sinks)


def schedule_for(schedule):
    """The plan's Schedule as the partial run follows it: kept spans are direct edges in
    the executor, so only uploaded copies are tickets the swap manager holds and frees."""
    uploaded = {key for keys in schedule.uploads for key in keys}
    result = copy.copy(schedule)
    result.reads = [{t: key for t, key in reads.items() if key in uploaded}
                    for reads in schedule.reads]
    result.frees = [[key for key in keys if key in uploaded] for keys in schedule.frees]
    result.kept = {}
    return result


class PartialRun:
    """The C-API names of a plan's partial run (its PartialRunGraph), resolved once."""

    def __init__(self, session, graph_names):
        graph = session.graph
        self.session = session
        self.graph_names = graph_names

        def output(name):
            return tf_private.tf_output(graph.get_tensor_by_name(name))

        self._setup_feeds = [output(n) for n in graph_names.setup_feeds]
        self._setup_fetches = [output(n) for n in graph_names.setup_fetches]
        self._calls = [([output(p.gate)] + [output(n) for n in p.feeds],
                        [output(n) for n in p.fetches]) for p in graph_names.programs]
        self._cancel = (output(graph_names.cancel_flag), output(graph_names.cancel_done))
        self._targets = [tf_private.c_op(graph.get_operation_by_name(n))
                         for n in graph_names.targets]
        self.wiring = [wiring(p) for p in graph_names.programs]

    def start(self):
        """A new partial run of the plan: its handle (the executor runs, gates closed)."""
        tf_private.extend_graph(self.session)
        return tf_c.TF_SessionPRunSetup_wrapper(tf_private.c_session(self.session),
                                                self._setup_feeds, self._setup_fetches,
                                                self._targets)

    def call(self, handle, index, args):
        """Run partition `index`; its fetched values (done token dropped)."""
        feeds, fetches = self._calls[index]
        feed_dict = dict(zip(feeds, [_OPEN] + [np.asarray(a) for a in args]))
        if index == len(self._calls) - 1:  # every feed and fetch consumed: the run ends
            feed_dict[self._cancel[0]] = _GO
            fetches = fetches + [self._cancel[1]]
            values = self._run(handle, feed_dict, fetches)
            return values[:-2]
        return self._run(handle, feed_dict, fetches)[:-1]

    def cancel(self, handle):
        """End a partial run that stopped early: the cancel check fails the executor,
        which then runs nothing more, and TensorFlow drops the run."""
        try:
            self._run(handle, {self._cancel[0]: _STOP}, [self._cancel[1]])
        except tf.errors.OpError:
            pass  # the expected failure, or a run TensorFlow had dropped already

    def _run(self, handle, feed_dict, fetches):
        return tf_c.TF_SessionPRun_wrapper(tf_private.c_session(self.session), handle,
                                           feed_dict, fetches)


class StepRun:
    """One step's partial run: started at its first call, cancelled if it stops early."""

    def __init__(self, partial_run):
        self._partial_run = partial_run
        self._handle = None
        self._open = False
        self.setup_time = 0.0

    def call(self, index, args):
        if self._handle is None:
            started = time.perf_counter()
            self._handle = self._partial_run.start()
            self._open = True
            self.setup_time = time.perf_counter() - started
        # A failed call leaves the run open here: DirectSession drops it after an error
        # while running, and stop() (ignoring "Must run 'setup'") covers the others.
        values = self._partial_run.call(self._handle, index, args)
        if index == len(self._partial_run.wiring) - 1:
            self._open = False
        return values

    def stop(self):
        """Cancel the partial run if the step ended before its last partition."""
        if self._open:
            self._open = False
            self._partial_run.cancel(self._handle)


class StoppingSwaps:
    """A step's SwapManager whose abort first ends the step's partial run (the executor
    would otherwise wait for the next gate, holding what it has, until the session closes)."""

    def __init__(self, swaps, step_run):
        self._swaps = swaps
        self._step_run = step_run

    def __getattr__(self, name):
        return getattr(self._swaps, name)

    def abort(self):
        try:
            self._step_run.stop()
        finally:
            self._swaps.abort()


class PartialStep:
    """The step loop's front end of a partial-run step (see step_loop); diagnoses
    failures as the callable front end `diagnosis` does."""

    def __init__(self, partial_run, step_run, diagnosis):
        self.plan = diagnosis.plan
        self.wiring = partial_run.wiring
        self._step_run = step_run
        self._diagnosis = diagnosis
        self.peaks = []  # never measured: a partial run has no step statistics
        self.scratch = {}

    def call(self, index, args):
        self.peaks.append(None)
        return self._step_run.call(index, args)

    @staticmethod
    def host_value(value):
        return value

    def out_of_memory(self, index, error):
        return self._diagnosis.out_of_memory(index, error)

    def failure(self, index, error):
        return self._diagnosis.failure(index, error)


def copy_plan(session, plan, scope, residence):
    """(PartialRun or None, the callables' Programs or a function making them): a plan
    whose steps can run as partial runs is copied for them now, and for its callables
    only when a step first needs them (options, run_metadata, measured peaks)."""
    graph = session.graph

    def for_callables():
        with graph.as_default():
            callable_scope = graph.unique_name("tfmem/plan", mark_as_used=True)
        return plan_import.rewrite_plan(graph, plan, callable_scope, residence)

    why = _unsupported(session, plan, residence)
    if why is not None:
        log.info("plan %s runs one callable per partition: %s", scope, why)
        return None, for_callables()
    return PartialRun(session, prun_import.import_plan(graph, plan, scope)), for_callables


def _unsupported(session, plan, residence):
    if not ENABLED:
        return "partial runs are off (partial_run.ENABLED)"
    if session.sess_str or not plan_import.supports(residence):
        return "a distributed session has no partial runs with session state"
    return prun_import.unsupported(session.graph, plan)
