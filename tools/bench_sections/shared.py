"""What the benchmark's sections share: medians, TensorFlow imported late (a capped
child sets its cap first), the sessions of both sides, tfmem's own call timing, and
Chrome traces of a few steps."""

import json
import statistics
import time

import tfmem

MIB = 1 << 20


def median(values):
    """The median, or None for no values."""
    return statistics.median(values) if values else None


def tensorflow():
    """TensorFlow, imported on first use: a capped child sets its cap before."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf


def timer_cost(calls=20000):
    """Seconds tfmem's own timing of a partition call adds to it (two clock reads and a
    sum, as in `tfmem.run.executing.step_loop`; StepStats.call_time), measured on a no-op call."""
    clock = time.perf_counter

    def call():
        return None

    started = clock()
    for _ in range(calls):
        call()
    bare = clock() - started
    total = 0.0
    started = clock()
    for _ in range(calls):
        called = clock()
        call()
        total += clock() - called
    return max((clock() - started - bare) / calls, 0.0)


def trace_durations(trace):
    """{track: (events, seconds)} of a Chrome trace written by tfmem (dict or path)."""
    if not isinstance(trace, dict):
        with open(trace, encoding="utf-8") as handle:
            trace = json.load(handle)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    totals = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        track = names.get(event["tid"], str(event["tid"]))
        count, seconds = totals.get(track, (0, 0.0))
        totals[track] = (count + 1, seconds + event["dur"] * 1e-6)
    return totals


def traced_steps(tfs, run, steps, path):
    """Run `steps` steps with a Chrome trace; per step the trace's durations and StepStats.

    Traces these steps only (`TFMemSession.tracing`).
    """
    if not hasattr(tfs, "tracing") or steps <= 0:
        return []
    out = []
    with tfs.tracing(path):
        for _ in range(steps):
            run()
            out.append((trace_durations(path), tfs.last_step))
    return out


def session_config(tf, name):
    """The session config of a bench side: "tfmem" (tfmem.session_config) or "default"."""
    config = tf.compat.v1.ConfigProto()
    return tfmem.session_config(config) if name == "tfmem" else config


def session(tf, graph, config="default"):
    """A plain session on `graph` with the config of session_config."""
    return tf.compat.v1.Session(graph=graph, config=session_config(tf, config))


def fmt(value, width, digits):
    """A right-aligned figure, or n/a."""
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"
