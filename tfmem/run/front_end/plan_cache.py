"""The plan cache of a TFMemSession: each request planned once and compiled once.

A request is planned on its first `run` (or `plan`, `simulate`) and its plan
copied into the session's graph on its first step; both happen under one lock,
since planning and adding ops to the graph must not interleave between threads.
Steps of a compiled request run outside the lock.  Entries are keyed by the
request's signature (plus its fed shapes in budget mode).
"""

import threading

from tfmem.memory.resident import ResidentCheck


class CompiledRequest:
    """A cached plan, its predicted memory, its executor once rewritten, and the graph
    version it was checked at."""

    def __init__(self, plan, graph_version, trace=None):
        self.plan = plan
        self.graph_version = graph_version
        self._trace = trace
        self._predict_later = None  # makes the trace when first read (see defer_prediction)
        self.executor = None
        self.correction = None  # budget.Correction of the request's plans, in budget mode
        self.replan = False  # budget mode learned from a step: plan again before the next
        self.resident = ResidentCheck()  # budget mode: does its plan still fit beside the device's bytes
        self.written = None  # resource variables its updates write (first_updates), once compiled
        self.assigned = None  # the variables it sets from constants (first_updates.assigned)
        self.released = False  # its executor was released after its first step
        # the executor of the entry this one replaced (a re-plan), until this one is
        # compiled: its partitions may be reused (run/compiling/reuse.py)
        self.replaced = None
        self.feed_shapes = None  # the fed shapes of its first step
        self.plan_time = 0.0  # seconds spent planning it
        self.schedule = None  # sampling.MeasureSchedule: which of its steps are measured
        self.last_measured = None  # StepStats of its last measured step
        # planned (or its prediction renewed) since its last step told the step listeners
        self.newly_planned = True

    @property
    def trace(self):
        """The predicted MemoryTrace (made now if its prediction was deferred), or None."""
        if self._trace is None and self._predict_later is not None:
            predict, self._predict_later = self._predict_later, None
            self._trace = predict()
        return self._trace

    @trace.setter
    def trace(self, value):
        self._trace, self._predict_later = value, None

    @property
    def predicted(self):
        return self._trace is not None or self._predict_later is not None

    @property
    def deferred(self):
        """True while the prediction waits for its first reader."""
        return self._trace is None and self._predict_later is not None

    def defer_prediction(self, predict):
        """Predict when the trace is first read: a plan that swaps nothing needs no host
        buffers, so its first step has nothing to check against the prediction."""
        self._predict_later = predict


class PlanCache:
    """The session's compiled requests, and the lock their planning and compiling share."""

    def __init__(self):
        self.entries = {}  # request key -> CompiledRequest
        self.lock = threading.Lock()  # plans and graph additions, one thread at a time

    def get(self, key):
        return self.entries.get(key)

    def add(self, key, plan, graph_version, trace=None):
        """A new entry for `key` (replacing any), planned but not yet compiled."""
        old = self.entries.get(key)
        entry = self.entries[key] = CompiledRequest(plan, graph_version, trace)
        if old is not None:
            entry.replaced = old.executor or old.replaced
        return entry

    def executors(self, signature):
        """The executors of the request `signature`'s compiled entries, for any shapes."""
        return list({id(e.executor): e.executor for key, e in self.entries.items()
                     if e.executor is not None
                     and (key == signature or key[:-1] == signature)}.values())

    def compiled_plans(self, signature):
        """Plans of the request `signature` already copied into the graph, for any shapes."""
        plans = {id(e.plan): e.plan for key, e in self.entries.items()
                 if e.executor is not None and key[:-1] == signature}
        return tuple(plans.values())

    def executor_of(self, plan):
        """The executor of an entry compiled for this plan (or an equal one), or None."""
        for other in self.entries.values():
            if other.executor is not None and (other.plan is plan or other.plan == plan):
                return other.executor
        return None

    def compile_once(self, entry, compile_entry):
        """Call `compile_entry(entry)` unless the entry has its executor; of threads that
        race to compile one entry, exactly one does."""
        if entry.executor is None:
            with self.lock:
                if entry.executor is None:
                    compile_entry(entry)

    def clear(self):
        self.entries.clear()
