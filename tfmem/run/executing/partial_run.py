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
run.  A step that stops early in Python (Ctrl-C between partitions, an error
in tfmem) closes the gates of the partitions left: their ops are dead and
never run; it opens the stop gate, which closes the step's stacks (the kept
tensors); the executor finishes and frees what it held, without an error
(TensorFlow keeps a small record of the run, whose dead fetches stay
unfetched, until the session closes).

**A step that fails inside TensorFlow cancels the session.** DirectSession
gives a partial run's executor the session's own CancellationManager, and an
executor that fails cancels it: every later run of that session, partial
or not, fails with "Run call was cancelled" (checked on TensorFlow 2.21).
So partial runs are opt-in (`tfmem.Options(partial_runs=True)`), for jobs
whose steps do not fail or that make a new session when one does; tfmem
then raises `SessionCancelledError` instead of running a step on it.

A partial run takes no RunOptions and returns no RunMetadata, so steps with
`options` or `run_metadata` run the callables (see execute), and so do steps
measuring device peaks from step statistics, except in budget mode, where a
measured step stays a partial run and reads TensorFlow's process figures
around each call instead (call_peaks).  The C API is called directly:
Python's `Session.partial_run` rebuilds its fetch handler on every call.
"""

import copy
import logging
import time

import numpy as np
from tensorflow.python.client import pywrap_tf_session as tf_c
import tensorflow as tf

from tfmem.errors import TFMemError
from tfmem.run.compiling import plan_import, prun_import
from tfmem.run.executing.step_loop import Wiring
from tfmem import tf_private

log = logging.getLogger(__name__)


class SessionCancelledError(TFMemError):
    """A partial-run step failed inside TensorFlow, which cancelled the session for good."""


def cancelled_error(cause):
    return SessionCancelledError(
        "this session was cancelled by TensorFlow when a step run as a partial run failed "
        f"({type(cause).__name__}: {cause.message.splitlines()[0]}); DirectSession cancels "
        "the whole session when a partial run's op fails, so every later run of it fails. "
        "To change: make a new session (restore your variables from a checkpoint), or "
        "leave tfmem.Options(partial_runs=False), whose failed steps leave the session usable")


_OPEN = np.asarray(True)
_CLOSED = np.asarray(False)
_NO_TICKET = np.asarray(b"", dtype=object)


def wiring(program):
    """The step loop's Wiring of a partial-run call (the gate is fed by the call itself)."""
    return Wiring(program.feed_sources, program.fetch_sinks)


def schedule_for(schedule):
    """The plan's Schedule as the partial run follows it: kept spans wait on the step's
    stacks, in-graph (see prun_import), so only uploaded copies are tickets the swap
    manager holds and frees (and counts in StepStats' handle peaks)."""
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
        self._targets = [tf_private.c_op(graph.get_operation_by_name(n))
                         for n in graph_names.targets]
        self._stop = (output(graph_names.stop_gate), output(graph_names.stop_done))
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
            feed_dict[self._stop[0]] = _CLOSED
            return self._run(handle, feed_dict, fetches + [self._stop[1]])[:-2]
        return self._run(handle, feed_dict, fetches)[:-1]

    def close_from(self, handle, index, step_feeds):
        """End a run stopped before partition `index`: its gate and every later one
        closed (their ops dead), the other feeds given what the step has (fed
        values; an empty ticket for uploads, whose reads are dead too)."""
        feed_dict = {self._stop[0]: _OPEN}  # close the stacks: free what they hold
        for k in range(index, len(self._calls)):
            gate, *feeds = self._calls[k][0]
            feed_dict[gate] = _CLOSED
            for output, source in zip(feeds, self.graph_names.programs[k].feed_sources):
                value = step_feeds.get(source)
                feed_dict[output] = _NO_TICKET if value is None else np.asarray(value)
        self._run(handle, feed_dict, [self._stop[1]])

    def _run(self, handle, feed_dict, fetches):
        return tf_c.TF_SessionPRun_wrapper(tf_private.c_session(self.session), handle,
                                           feed_dict, fetches)


class StepRun:
    """One step's partial run: started at its first call, closed if it stops early."""

    def __init__(self, partial_run, feeds):
        self._partial_run = partial_run
        self._feeds = feeds  # the step's fed values by tensor name
        self._handle = None
        self._next = 0  # the partition whose call comes next
        self.failed = None  # the OpError a call raised: the session is cancelled
        self.setup_time = 0.0

    def call(self, index, args):
        if self._handle is None:
            started = time.perf_counter()
            self._handle = self._partial_run.start()
            self.setup_time = time.perf_counter() - started
        try:
            values = self._partial_run.call(self._handle, index, args)
        except tf.errors.OpError as err:
            self.failed = err  # TensorFlow dropped the run (and cancelled the session)
            self._next = None
            raise
        self._next = index + 1
        return values

    def stop(self):
        """Close the partial run if the step ended before its last partition."""
        if self._handle is not None and self._next is not None and \
                self._next < len(self._partial_run.wiring):
            index, self._next = self._next, None
            try:
                self._partial_run.close_from(self._handle, index, self._feeds)
            except tf.errors.OpError as err:  # not expected: say so, keep the step's error
                log.warning("could not close a stopped step's partial run: %s",
                            err.message.splitlines()[0])


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

    def __init__(self, partial_run, step_run, diagnosis, call_peaks=None):
        self.plan = diagnosis.plan
        self.wiring = partial_run.wiring
        self._step_run = step_run
        self._diagnosis = diagnosis
        # A partial run has no step statistics: its peaks, where measured, come from the
        # process figures around each call (call_peaks.CallPeaks), else None.
        self._call_peaks = call_peaks
        self.peaks = []
        self.scratch = {}  # no per-op statistics either (see session: learning)

    def call(self, index, args):
        if self._call_peaks is None:
            self.peaks.append(None)
            return self._step_run.call(index, args)
        self._call_peaks.start_call()
        values = self._step_run.call(index, args)
        self._call_peaks.end_call()
        self.peaks.append(self._call_peaks.partition_peaks[-1])
        return values

    @staticmethod
    def host_value(value):
        return value

    def out_of_memory(self, index, error):
        return self._diagnosis.out_of_memory(index, error)

    def failure(self, index, error):
        return self._diagnosis.failure(index, error)


def copy_plan(session, plan, scope, residence, enabled=True, callables_plan=None,
              one_import=True, reused=None):
    """(PartialRun or None, the callables' Programs or a function making them): a plan
    whose steps can run as partial runs is copied for them now, and for its callables
    only when a step first needs them (options, run_metadata, measured peaks).
    `callables_plan`: what the callables run (the plan's stretches, see stretches);
    `one_import`: copy them in one import where the residence allows (plan_import);
    `reused`: {partition of `callables_plan`: Program} an earlier plan compiled, taken
    by a plan that runs callables (see reuse)."""
    graph = session.graph

    def for_callables(reused=None):
        with graph.as_default():
            callable_scope = graph.unique_name("tfmem/plan", mark_as_used=True)
        return plan_import.rewrite_plan(graph, callables_plan or plan, callable_scope,
                                        residence, one_import, reused)

    why = _unsupported(session, plan, residence) if enabled else "partial_runs=False"
    if why is not None:
        log.info("plan %s runs callables, not partial runs: %s", scope, why)
        return None, for_callables(reused)
    return PartialRun(session, prun_import.import_plan(graph, plan, scope)), for_callables


def _unsupported(session, plan, residence):
    if session.sess_str or not plan_import.supports(residence):
        return "a distributed session has no partial runs with session state"
    return prun_import.unsupported(session.graph, plan)
