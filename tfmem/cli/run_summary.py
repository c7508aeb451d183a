"""What `tfmem run` prints at exit: per session, what its steps cost.

A `RunRecorder` listens to the steps of every TFMemSession of the process
(TFMemSession calls its step listeners after each step, from whichever
thread ran it) and keeps running totals, not per-step lists, so a long
program costs it nothing but a few integers.  For each request it also asks
the simulator what plain TensorFlow's step would need (the same request as
one partition): measuring that would mean running the step twice, which a
step with stateful ops must never be.
"""

import dataclasses
import json
import logging
import sys
import threading

from tfmem.plan.build import make_plan
from tfmem.memory.shapes import resolve_shapes
from tfmem.memory.simulate import simulate
from tfmem.plan.swap import SwapPolicy
from tfmem.memory.sizes import MIB

log = logging.getLogger(__name__)



@dataclasses.dataclass
class SessionTotals:
    """Running totals of one session's steps."""
    index: int
    steps: int = 0
    partitions_run: int = 0
    most_partitions: int = 0
    swapped_out_bytes: int = 0
    swapped_in_bytes: int = 0
    device_peak_bytes: int | None = None  # TensorFlow's allocator, where it keeps figures
    host_rss_peak_bytes: int = 0
    wall_time: float = 0.0
    requests: int = 0  # distinct requests run
    predicted_peak_bytes: int = 0  # tfmem's plans, largest
    predicted_plain_peak_bytes: int | None = None  # the same requests as one partition
    plain_runs: int = 0  # steps run by the plain session (a request tfmem could not plan)
    plain_reasons: list = dataclasses.field(default_factory=list)


def _plain_peak(graph, plan, feed_shapes):
    """The simulator's peak for the request run whole, as plain TensorFlow runs it."""
    whole = make_plan(plan.view, max(1, plan.num_ops), SwapPolicy(mode="none"))
    return simulate(whole, resolve_shapes(graph, whole.view, feed_shapes or {})).peak_device


class RunRecorder:
    """Totals per TFMemSession, filled by step listeners on any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals = {}  # id(TFMemSession) -> SessionTotals
        self._entries = {}  # id(TFMemSession) -> ids of the plans already accounted for
        self._keep = []  # the sessions, so ids stay unique while the process runs

    def watch(self, tfs):
        with self._lock:
            self._totals[id(tfs)] = SessionTotals(index=len(self._totals) + 1)
            self._entries[id(tfs)] = set()
            self._keep.append(tfs)
        tfs.add_step_listener(self.on_step)

    def on_step(self, tfs, record):
        stats, new_plan = record.stats, False
        with self._lock:
            totals = self._totals[id(tfs)]
            totals.steps += 1
            totals.partitions_run += stats.partitions
            totals.most_partitions = max(totals.most_partitions, stats.partitions)
            totals.swapped_out_bytes += stats.swapped_out_bytes
            totals.swapped_in_bytes += stats.swapped_in_bytes
            if stats.device_peak_bytes is not None:
                totals.device_peak_bytes = max(totals.device_peak_bytes or 0,
                                               stats.device_peak_bytes)
            totals.host_rss_peak_bytes = max(totals.host_rss_peak_bytes, stats.host_rss_bytes)
            totals.wall_time += stats.wall_time
            if id(record.plan) not in self._entries[id(tfs)]:
                self._entries[id(tfs)].add(id(record.plan))
                totals.requests += 1
                totals.predicted_peak_bytes = max(totals.predicted_peak_bytes,
                                                  record.prediction().peak_device)
                new_plan = True
        if new_plan:
            self._predict_plain(tfs, record, totals)

    def _predict_plain(self, tfs, record, totals):
        try:
            peak = _plain_peak(tfs.graph, record.plan, record.feed_shapes)
        except Exception as error:  # pylint: disable=broad-except
            log.debug("no plain prediction for a request: %s", error)
            return
        with self._lock:
            totals.predicted_plain_peak_bytes = max(totals.predicted_plain_peak_bytes or 0, peak)

    def on_plain_run(self, tfs, reason):
        """A step the wrapped session ran plainly, because tfmem could not plan it."""
        with self._lock:
            totals = self._totals[id(tfs)]
            totals.plain_runs += 1
            if reason not in totals.plain_reasons:
                totals.plain_reasons.append(reason)

    def totals(self):
        with self._lock:
            return [dataclasses.replace(t, plain_reasons=list(t.plain_reasons))
                    for t in self._totals.values()]

    def as_dict(self, settings):
        return {"settings": settings, "sessions": [dataclasses.asdict(t) for t in self.totals()]}

    def write_json(self, path, settings):
        with open(path, "w", encoding="utf-8") as out:
            json.dump(self.as_dict(settings), out, indent=1)

    def print(self, settings, stream=None):
        stream = stream or sys.stderr
        sessions = [t for t in self.totals() if t.steps or t.plain_runs]
        print(f"tfmem: {len(sessions)} session(s) ran steps ({settings})", file=stream)
        for t in sessions:
            print(f"tfmem: {describe(t)}", file=stream)
        warning = nothing_wrapped(self.totals())
        if warning:
            print(f"tfmem: WARNING: {warning}", file=stream)


def nothing_wrapped(totals):
    """Why no step ran through tfmem, from the sessions' totals; None if some did."""
    if any(t.steps for t in totals):
        return None
    if not totals:
        return ("nothing ran through tfmem: the program created no tf.compat.v1.Session or "
                "InteractiveSession. A TensorFlow 2 program (eager code, tf.function, Keras "
                "fit) is not wrapped by `tfmem run`: wrap its step with tfmem.function or "
                "its model with tfmem.keras.partitioned.")
    plain = sum(t.plain_runs for t in totals)
    if plain:
        return (f"nothing ran through tfmem: every request of the program's {len(totals)} "
                f"session(s) ran plainly ({plain} runs; tfmem could not plan them, see the "
                "reasons above).")
    return (f"nothing ran through tfmem: the program created {len(totals)} session(s) but "
            "ran no step in them (was the work done by another kind of session, or in "
            "eager mode?).")


def _size_text(value):
    if value is None:
        return "n/a"
    return f"{value / MIB:.1f} MiB" if value >= MIB // 10 else f"{value / 1024:.1f} KiB"


def describe(t):
    """One line about one session's totals."""
    measured = ("not measured (TensorFlow's CPU allocator keeps no figures)"
                if t.device_peak_bytes is None else f"{_size_text(t.device_peak_bytes)} measured")
    line = (f"session {t.index}: {t.steps} steps of {t.requests} request(s), "
            f"{t.partitions_run} partitions run (up to {t.most_partitions} per step), "
            f"{t.wall_time:.2f} s in steps; device peak {measured}, predicted "
            f"{_size_text(t.predicted_peak_bytes)}, plain TensorFlow predicted "
            f"{_size_text(t.predicted_plain_peak_bytes)}; swapped out {_size_text(t.swapped_out_bytes)}, "
            f"in {_size_text(t.swapped_in_bytes)}; host RSS peak {_size_text(t.host_rss_peak_bytes)}")
    if t.plain_runs:
        line += (f"; {t.plain_runs} step(s) run plainly, not partitioned: "
                 + "; ".join(t.plain_reasons))
    return line
