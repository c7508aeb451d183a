"""Budget mode between and around steps, for both front ends (TFMemSession, tfmem.function).

    before a step   the plan no longer fits beside what the device holds now
                    (tfmem.memory.resident)?  --> plan again first
    the step        ran out of device memory --> learn (tfmem.memory.learning); before
                    any op that changes state could have run, and at most RUNS_AGAIN
                    times: plan again and run it again at once; else raise
    after a step    measured over its prediction --> learn; plan again before the next

A front end's cached plan (an "entry": a TFMemSession's CompiledRequest, a
tfmem.function's trace) carries `plan`, `trace` (the prediction it was fitted
to), `correction` (what was learned, None until something was), `replan` and
`resident` (a ResidentCheck).  What differs between the front ends is passed in:
how to measure an entry's kernels again and its Sizing.
"""

import contextlib
import gc

from tfmem import errors
from tfmem.memory import budget, learning, oom
from tfmem.memory.simulate import TensorSizes, state_bytes
from tfmem.plan import updates
from tfmem.run.placement import accelerator


class BudgetLearning:
    """The learning of one front end's plans under one device-memory budget.

    `budget_bytes`: None outside budget mode (nothing is learned, nothing run again);
    `devices`: the session, or the eager devices, whose memory the budget is of;
    `device`: the device TensorFlow's figures are read on, where `measure_device`;
    `measure_scratch(entry)`: the entry's kernel scratch measured again;
    `sizing(entry)`: the entry's Sizing; `what`: the front end in log lines."""

    def __init__(self, budget_bytes, devices, device, measure_device, measure_scratch, sizing,
                 what="the request"):
        self.budget_bytes = budget_bytes
        self._devices, self._device, self._measure_device = devices, device, measure_device
        self._measure_scratch, self._sizing = measure_scratch, sizing
        self._what = what

    def _device_memory(self):
        """TensorFlow's figures of the device now ({"current", "peak", ...} bytes), or
        None where it keeps none or the front end does not measure."""
        return accelerator.device_memory(self._device) if self._measure_device else None

    def device_in_use(self):
        """The device's bytes in use now, or None where TensorFlow keeps no figures."""
        memory = self._device_memory()
        return memory["current"] if memory else None

    def device_in_use_for_planning(self, view, sizing):
        """`device_in_use()` for a plan of `view` at `sizing` to be fitted beside.

        Where the device holds more than the request's own state, part of it may be
        garbage: a function or session the program dropped, or a failed step's
        traceback, in a reference cycle with device tensors until Python's cyclic
        collector happens to run.  A plan fitted beside it would depend on when that
        last ran, so the collector runs first (not otherwise: a full collection takes
        about a second beside a 100k-op graph)."""
        in_use = self.device_in_use()
        if in_use is not None and in_use > state_bytes(view, TensorSizes(view, sizing.shapes)):
            gc.collect()
            in_use = self.device_in_use()
        return in_use

    def outgrown(self, entry):
        """Before a step: whether the entry's plan no longer fits beside what the device
        holds now (see tfmem.memory.resident)."""
        return entry.resident.outgrown(entry.trace, self.budget_bytes, self.device_in_use(),
                                       entry.correction, self._what)

    def after_step(self, entry, stats):
        """After a step of the entry (`stats`, its own figures: other threads' steps may
        have run since): when it measured over its prediction, correct the model and plan
        again before the next step (this one is never run again)."""
        entry.resident.record(stats)
        scratch_seen, predict = self._inputs(entry)
        if learning.learn_from_step(
                entry.correction, entry.trace, stats.partition_peak_bytes,
                stats.resident_bytes, scratch_seen, predict, what=self._what,
                whole_device=budget.on_whole_device(self.budget_bytes, entry.trace.regions)):
            entry.replan = True

    def after_out_of_memory(self, entry, index, run_again=False, unchanged=False,
                            request=None, failed_op=None):
        """After a step ran out of device memory in partition `index` (on an allocation of
        `request` bytes by `failed_op`, None: unknown): correct the model and plan again
        before the entry's next step; the sentence the error adds.  `run_again`: the step
        changed no state before it failed and runs again at once."""
        unsized = None  # (op, bytes) of an allocation the model did not size
        if request is not None and not oom.modelled_request(
                entry.plan, self._sizing(entry), index, request, failed_op):
            if failed_op in entry.plan.view.nodes:
                unsized = (failed_op, request)
            request = None  # the bytes were missing from the model: not a layout's fault
        scratch_seen, predict = self._inputs(entry)
        entry.resident.ran_out()
        device = accelerator.device_capacity(self._devices)
        memory = self._device_memory()
        message = learning.learn_from_out_of_memory(
            entry.correction, entry.trace, index, device or self.budget_bytes,
            memory["current"] if memory else None, scratch_seen, predict, what=self._what,
            run_again=run_again, unchanged=unchanged, request=request,
            peak=memory["peak"] if memory else None, limit=device, unsized=unsized)
        entry.replan = True
        return message

    def _inputs(self, entry):
        """(measure the entry's kernels again, predict its plan with given scratch), the
        entry's Correction made if it has none."""
        if entry.correction is None:
            entry.correction = budget.Correction()
        return (lambda: self._measure_scratch(entry),
                lambda extra: budget.predict(entry.plan, self._sizing(entry), extra))

    def run_step(self, prepare, execute, learns=lambda: True, lock=contextlib.nullcontext):
        """(entry, what `execute(entry)` returned) of one step: `prepare()` gives the entry
        to run (planned, compiled).  In budget mode (and while `learns()`), a step that runs
        out of device memory teaches the model (under `lock()`); one that changed no state
        before it failed is prepared and run again, at most learning.RUNS_AGAIN times."""
        failed = None  # the DeviceMemoryError of the step's last run, when it runs again
        for again in range(learning.RUNS_AGAIN, -1, -1):
            try:
                entry = prepare()
            except errors.BudgetError as no_plan:
                if failed is None:
                    raise
                failed.add_note(f"Planned again, nothing fits: {no_plan}")
                raise failed  # (its context: no_plan)
            try:
                return entry, execute(entry)
            except errors.DeviceMemoryError as err:
                if self.budget_bytes is None or not learns():
                    raise
                unchanged = updates.unchanged_before(entry.plan, err.partition, err.failed_op)
                run_again = unchanged and again > 0
                with lock():
                    err.add_note(self.after_out_of_memory(entry, err.partition, run_again,
                                                          unchanged, err.request,
                                                          err.failed_op))
                if not run_again:
                    raise
                failed = err
        raise AssertionError("unreachable: the last run raises or returns")
