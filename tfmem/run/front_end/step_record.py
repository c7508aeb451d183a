"""StepRecord: what a step listener (`TFMemSession.add_step_listener`) is told of a step.

    tfs.add_step_listener(lambda tfs, record: print(record.step, record.planned,
                                                    record.stats.wall_time))

A read-only value made after every step: the step's StepStats, the Plan that
ran it, whether the step began by planning its request and what compiling
it cost.  The plan's predicted memory is made only when asked
(`prediction()`): a plan that swaps nothing is not predicted before then.
"""

import dataclasses
import inspect
import warnings


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step of a TFMemSession, as its step listeners see it."""
    step: int  # StepStats.step: the session's steps numbered from 1
    stats: object  # the step's StepStats (its timings, transfers, measured peaks)
    plan: object  # the tfmem.Plan that ran it
    # the step began by planning its request: the request's first step, a step after
    # budget mode learned (even when the plan it fitted is the same) or new fed shapes
    planned: bool
    compile: object  # the CompileStats of what this step compiled, or None
    feed_shapes: dict  # {fed tensor name: shape} the plan was made for
    _predict: object = dataclasses.field(repr=False, compare=False, default=None)

    def prediction(self):
        """The plan's predicted MemoryTrace, as memory_report() compares with the step."""
        return self._predict()


def listener_taking_records(listener):
    """`listener` as called after every step, `listener(tfs, record)`; one that takes
    `(tfs, entry, stats)` is called with the StepRecord in the entry's place, and warned
    about (DeprecationWarning)."""
    try:
        inspect.signature(listener).bind(None, None)
        return listener
    except TypeError:
        pass
    except ValueError:  # no signature to read (a builtin): called as given
        return listener
    warnings.warn("a step listener taking (tfs, entry, stats) is deprecated: it is given a "
                  "tfmem.StepRecord as the entry; take (tfs, record) and read record.stats",
                  DeprecationWarning, stacklevel=3)
    return lambda tfs, record: listener(tfs, record, record.stats)
