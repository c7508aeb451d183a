"""Which steps of a plan are measured: allocation tracking is not free.

A measured step runs its partitions with SOFTWARE_TRACE so that TensorFlow
records every allocation (see execute.measured_peak); that costs a quarter of
a small step.  A plan's figures settle after a few steps, so by default the
first steps of each plan are measured until they agree, and after that only
one step in `SAMPLE_EVERY`.  A sampled step whose figures moved starts the
warm-up again; a re-plan starts a new schedule (session.py).
"""

MODES = ("sample", "every", "off")
SAMPLE_EVERY = 50  # steps between two measured ones once the figures are stable
WARMUP_STEPS = 3  # at least this many first steps of a plan are measured
STABLE_STEPS = 3  # ... and until this many measured steps in a row agree
# Agree: step peaks within 2 % or 1 MiB of each other.  Single partitions' peaks move by
# an allocator chunk (256 KiB) from step to step (prefetch timing), and the step peak of
# a small step by as much: not a change worth measuring every step for.
TOLERANCE = 0.02
TOLERANCE_BYTES = 1 << 20


def check_mode(value):
    """The measure mode, or a ValueError that names the choices."""
    if not isinstance(value, str) or value not in MODES:
        raise ValueError(f"measure must be one of {', '.join(repr(m) for m in MODES)} "
                         f"('sample': the first steps of each plan, then one step in "
                         f"{SAMPLE_EVERY}; 'every': every step; 'off': none), got {value!r}")
    return value


def _agree(a, b):
    return abs(a - b) <= max(TOLERANCE * max(a, b), TOLERANCE_BYTES)


class MeasureSchedule:
    """Decides, step by step, whether the next step of one plan is measured."""

    def __init__(self, mode="sample"):
        self.mode = check_mode(mode)
        self.steps = 0  # steps of this plan run so far
        self._recent = []  # step peaks of the last measured steps in a row
        self._stable_since = None  # step at which the figures were found stable

    @property
    def stable(self):
        return self._stable_since is not None

    def wants(self):
        """True when the next step is to be measured."""
        if self.mode == "every":
            return True
        if self.mode == "off":
            return False
        if not self.stable:
            return True
        return (self.steps + 1 - self._stable_since) % SAMPLE_EVERY == 0

    def record(self, peaks):
        """After a step: its measured partition peaks (None when it was not measured)."""
        self.steps += 1
        if peaks is None:
            return
        peak = max(peaks)
        if self.stable and not all(_agree(peak, r) for r in self._recent):
            self.restart()  # a sampled step moved: measure every step until it settles
        self._recent = (self._recent + [peak])[-STABLE_STEPS:]
        if (not self.stable and self.steps >= WARMUP_STEPS
                and len(self._recent) == STABLE_STEPS
                and all(_agree(self._recent[0], r) for r in self._recent[1:])):
            self._stable_since = self.steps

    def restart(self):
        """Measure every step again until the figures agree (the model was corrected)."""
        self._recent = []
        self._stable_since = None
