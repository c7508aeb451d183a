"""The plans of a TFMemSession's requests: made once, cached, made again when they must be.

    request --> cached entry (plan_cache)?
                  the graph changed what it reaches      --> analysed and planned again
                  budget mode learned, or the plan no
                  longer fits beside the device's bytes  --> fitted again (the same plan
                                                             kept when it still fits, else
                                                             its partitions over the budget
                                                             split: memory/refine.py)
            --> none: analyse, plan (or fit the budget), the placement pass's outcome,
                the updates gathered into the last partition (atomic_updates)

Settings fixed with the session (`PlanSettings`) are part of every plan; the
placement pass runs over ops before the session places them.
"""

import dataclasses
import logging
import time

from tfmem.memory import budget, first_updates, refine
from tfmem.plan import updates
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan
from tfmem.plan.gc_pause import gc_paused
from tfmem.plan.partition import check_partition_size
from tfmem.plan.place import place
from tfmem.run.placement import accelerator
from tfmem.run.compiling import regrouping
from tfmem.run.front_end import remote
from tfmem.run.placement.placement_pass import Record, place_state_on_host
from tfmem import tf_private

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PlanSettings:
    """What every plan of one session is made with, fixed when the session is wrapped."""
    partition_size: object  # an int, or "auto" (budget mode)
    policy: object  # the SwapPolicy
    budget: int | None  # budget mode's bytes, or None
    accelerator: str | None  # the device the placement pass moves state off, or None
    atomic_updates: bool
    regrouped_arithmetic: bool  # the session reorders sums (regrouping); part of every view
    removes_identities: bool  # the session removes IdentityN ops (regrouping); likewise
    chains_copies: bool  # each partition's copies run in one order (op_order.chained_order)

    @classmethod
    def of(cls, sess, partition_size, device_memory_budget, policy, options, remote_info):
        """The settings of a TFMemSession of `sess` (see TFMemSession for the arguments)."""
        size = check_partition_size(partition_size)
        budget_bytes = None
        if device_memory_budget is not None or partition_size == "auto":
            remote.check_budget_source(sess, device_memory_budget is not None)
            size, budget_bytes = "auto", accelerator.memory_budget(sess, device_memory_budget)
        if policy.mode == "auto" and budget_bytes is None and not accelerator.has_own_memory(sess):
            # The "device" is host memory itself: a host copy would free nothing.
            policy = dataclasses.replace(policy, mode="none")
            log.info("swap='auto' on a CPU session without a memory cap or budget: "
                     "cross-partition tensors stay where they are (swap='all' forces swaps)")
        return cls(
            size, policy, budget_bytes,
            accelerator.accelerator_of(sess, options.accelerator_device)
            if options.place_state_on_host else None,
            remote.is_distributed(sess) if options.atomic_updates is None
            else options.atomic_updates,
            regrouping.session_regroups_arithmetic(sess),
            regrouping.session_removes_identities(sess),
            # Copies are chained on a local session only: on TensorFlow's distributed
            # runtime a chain through ops of several tasks would run the tasks one after
            # the other.  Nor in budget mode yet: its bound (the worst of the executor's
            # orders, kernels at once) is what its experiments validated; fitted to the
            # chained order alone, ResNet's quick search ran out of memory
            # (docs/how-it-works.md, The memory model).
            options.chain_copies and remote_info is None and budget_bytes is None)


class RequestPlanner:
    """Plans a session's requests into its PlanCache's entries (see the module docstring).

    `sizing(view, feed_shapes)`: a request's Sizing; `learning`: budget mode's
    BudgetLearning."""

    def __init__(self, session, settings, plans, learning, sizing):
        self._session = session
        self.settings = settings
        self._plans = plans
        self._learning = learning
        self._sizing = sizing
        self._placed = Record()  # the placement pass's decisions on this session's graph
        # resource variables sharing no buffer with a kept constant (first_updates)
        self._owned = set()

    def place_state(self):
        """Run the placement pass over ops it has not seen, before the session places them."""
        if self.settings.accelerator is not None and self._session.graph.version and \
                not tf_private.is_closed(self._session):
            place_state_on_host(self._session, self.settings.policy.min_bytes, self._placed)

    def entry(self, request):
        """The cached plan of the request, planned again if the graph changed what it reaches."""
        with self._plans.lock:
            return self._entry_locked(request)

    def _analyse(self, request):
        return analyse(request.fetch_tensors, request.targets, request.feeds,
                       self.settings.regrouped_arithmetic, self.settings.chains_copies,
                       self.settings.removes_identities)

    def _entry_locked(self, request):
        key = request.signature
        if self.settings.budget is not None:  # the fitting plan depends on the shapes fed
            key += (tuple(sorted(request.feed_shapes().items())),)
        entry = self._plans.get(key)
        version = self._session.graph.version
        if entry is not None and entry.graph_version != version:
            # Planned again (below) only when this differs, after the placement pass
            # has seen the new ops: then it is analysed once more, by _make_plan.
            if self._analyse(request) != entry.plan.view:
                log.info("graph changed under a cached request; planning it again")
                entry = None
            else:
                entry.graph_version = version
        if entry is not None and self.settings.budget is not None and not entry.replan:
            entry.replan = self._learning.outgrown(entry)
        if entry is not None and entry.replan:
            entry = self._replanned(key, entry, request, version)
        if entry is None:
            started = time.perf_counter()
            plan, trace = self._make_plan(request)
            entry = self._plans.add(key, plan, version, trace)
            entry.plan_time = time.perf_counter() - started
        return entry

    def _replanned(self, key, entry, request, version):
        """Budget mode, the entry fitted again with what was learned: a new entry for a new
        plan, else the same one with its prediction renewed."""
        entry.replan = False
        started = time.perf_counter()
        plan, trace = self._make_plan(request, entry.correction, entry.plan.view)
        if plan != entry.plan:
            log.info("request planned again with the corrected model: %d partitions "
                     "(partition_size=%s), was %d", len(plan.partitions),
                     plan.partition_size, len(entry.plan.partitions))
            correction = entry.correction
            entry = self._plans.add(key, plan, version, trace)
            entry.correction = correction
            entry.plan_time = time.perf_counter() - started
            return entry
        # the same plan, predicted with what was learned (gather drops a stale trace)
        entry.trace = trace if trace is not None else budget.predict(
            entry.plan, self._sizing(entry.plan.view, request.feed_shapes()),
            entry.correction.scratch if entry.correction else None)
        if entry.schedule is not None:
            entry.schedule.restart()  # measure every step until it settles again
        entry.newly_planned = True
        return entry

    def _make_plan(self, request, correction=None, view=None):
        """(plan, predicted trace or None) for the request, with the placement pass's outcome.

        `view`: the request already analysed (after the placement pass), if it was."""
        self.place_state()
        settings = self.settings
        plan, trace = self._plan_request(request, view, correction)
        placement = place(plan.view, settings.accelerator, settings.policy.min_bytes,
                          self._placed)
        if plan.placement != placement:  # else keep the plan: it may be a compiled one
            plan = dataclasses.replace(plan, placement=placement)
        if settings.atomic_updates:
            return updates.gather(plan, trace)
        return plan, trace

    def _plan_request(self, request, view, correction=None):
        """(plan, predicted trace or None) for the request under this session's settings,
        analysed here unless `view` is given."""
        settings = self.settings
        with gc_paused():
            if view is None:
                view = self._analyse(request)
            if settings.budget is None:
                return make_plan(view, settings.partition_size, settings.policy,
                                 settings.accelerator), None
            sizing = self._sizing(view, request.feed_shapes())
            resident = (self._learning.device_in_use_for_planning(view, sizing) or 0) \
                + first_updates.pending_bytes(self._session.graph, view, self._owned)
            return budget.fit(view, sizing, settings.budget,
                              settings.policy, settings.accelerator, resident_bytes=resident,
                              correction=correction,
                              prefer=self._plans.compiled_plans(request.signature),
                              refine=refine.split_over_budget)

    def note_buffers(self, entry):
        """After a step of `entry`: which variables now own their buffers (first_updates).

        Its updates have copied what they shared.  An initializing request's executor
        keeps the constants it set variables from, sharing their buffers: released after
        its first step, they free, and the variables own their buffers, or share one
        among themselves (equal values merged), which costs nothing past the state: each
        copy replaces a share the state already counts.  Run again, it compiles once more
        and is kept (a request run every step must not compile every step)."""
        self._owned.update(entry.written)
        if not entry.assigned:
            return
        if entry.released:
            self._owned.difference_update(entry.assigned)
            return
        with self._plans.lock:
            entry.executor, entry.released = None, True
        self._owned.update(entry.assigned)
        log.info("released the executor of a request that set %d variables from constants: "
                 "the constants it kept are freed", len(entry.assigned))
