"""Trace: a step's timeline as a Chrome trace (chrome://tracing, Perfetto).

The executor records what happened when, on one track each: the partitions
on the main thread, swap-outs into host buffers, uploads on the prefetch
thread, and the main thread's waits for them.  `write_chrome_trace` writes
the events as Chrome's JSON trace format: complete events ("ph": "X") with
microsecond timestamps, one thread id per track.
"""

import json
import threading
import time

TRACKS = ("partitions", "swap-out", "prefetch", "wait")


class Timeline:
    """Events of one step: (track, name, start, end, args), times in seconds from the start."""

    def __init__(self):
        self.origin = time.perf_counter()
        self.events = []
        self._lock = threading.Lock()

    def span(self, track, name, started, args=None):
        """Record an event that began at perf_counter() `started` and ends now."""
        now = time.perf_counter()
        with self._lock:
            self.events.append((track, name, started - self.origin, now - self.origin, args or {}))


class NoTimeline:
    """The timeline of a step that is not traced: records nothing, so code that
    times something calls `span` without first asking whether anyone listens."""

    events = ()

    def span(self, track, name, started, args=None):
        """Record nothing."""


NO_TIMELINE = NoTimeline()


def chrome_trace(events):
    """The Chrome trace JSON object of timeline events."""
    tids = {track: i for i, track in enumerate(TRACKS)}
    trace = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": track}}
             for track, tid in tids.items()]
    for track, name, start, end, args in events:
        trace.append({"ph": "X", "name": name, "pid": 1, "tid": tids.setdefault(track, len(tids)),
                      "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6, "args": args})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(events, path):
    """Write timeline events to `path` as a Chrome trace."""
    with open(path, "w", encoding="utf-8") as out:
        json.dump(chrome_trace(events), out)
