"""A trial's step times told apart: the first step, the re-plans, the steady state.

A request's first step plans and compiles it (for plain TensorFlow: the
session builds its executor).  In budget mode tfmem plans a request again
when a step measured over its prediction (or no longer fits beside what the
device holds), so the step after such a one pays for planning, and for
compiling when the plan changed.  Neither is the speed of training: the
steady-state time is the median of the steps after the last re-plan, and a
trial runs until it has enough of them, up to a bound.

No TensorFlow import here: the search's process uses these too.
"""

import statistics

STEADY_STEPS = 5  # steps after the last re-plan whose median is the steady-state time
MAX_STEPS = 20  # a trial's bound when re-plans keep coming


class ReplanWatch:
    """Which steps of a TFMemSession began by planning their request (again).

    A step listener (TFMemSession.add_step_listener, after the step): its StepRecord
    says whether the step planned (the first step, a re-plan after budget mode learned,
    whether or not the plan changed, a new feed shape) and compiled.  Watch one
    request: attach after other requests (the initializer) have run.
    """

    def __init__(self, tfs):
        self.planned, self.compiled = [], []  # per step seen, in order
        tfs.add_step_listener(self._on_step)

    def _on_step(self, tfs, record):
        del tfs
        self.planned.append(record.planned)
        self.compiled.append(record.compile is not None)


def done(planned, steps, max_steps, steady_steps=STEADY_STEPS):
    """Whether a trial may stop after the steps run so far.

    `planned`: per step run, whether it began by planning; `steps`: a fixed step
    count (None: run until `steady_steps` steps follow the last re-plan, at most
    `max_steps`).
    """
    if steps is not None:
        return len(planned) >= steps
    return len(planned) >= max_steps or since_last_plan(planned) >= steady_steps


def since_last_plan(planned):
    """Steps run after the last one that planned (all of them when none planned)."""
    for back, was_planned in enumerate(reversed(planned)):
        if was_planned:
            return back
    return len(planned)


def split(step_times, planned, compiled=None, steady_steps=STEADY_STEPS):
    """The figures of a trial's steps (`planned`, `compiled`: per step, as ReplanWatch
    records them; the first step always plans).

    first_step_seconds; replans: steps after the first that planned again
    (replan_steps: their indexes; recompiles: how many of them compiled);
    steady_step_count and steady_seconds: the median of the steps after the last
    plan, None when fewer than `steady_steps` follow it.
    """
    count = len(step_times)
    planned = ([True] + [bool(p) for p in planned[1:count]]
               + [False] * (count - max(len(planned), 1)))[:count]
    compiled = list(compiled or [])
    replan_steps = [i for i, was in enumerate(planned) if was and i]
    steady = list(step_times[count - since_last_plan(planned):]) if count else []
    return dict(
        first_step_seconds=step_times[0] if step_times else None,
        replans=len(replan_steps), replan_steps=replan_steps,
        recompiles=sum(1 for i in replan_steps if i < len(compiled) and compiled[i]),
        steady_step_count=len(steady),
        steady_seconds=statistics.median(steady) if len(steady) >= steady_steps else None)


def ms_per_unit(steady_seconds, size, examples):
    """Milliseconds of a steady step per unit of work (size knob x examples), or None."""
    if steady_seconds is None or not size or not examples:
        return None
    return steady_seconds * 1000.0 / (size * examples)
