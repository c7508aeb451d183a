"""memory_report() pairs the last step with the prediction of the plan that ran it.

Two threads call one tfmem.function with two input signatures, whose traces
plan differently (1 and 3 layers: other partition counts, other predicted
peaks).  Thread A is paused right after its step became `last_step` (a trace
function stops it at the next line of `PartitionedFunction.__call__`): no
TensorFlow op runs there, so a py_function gate cannot reach that point.
Thread B then runs a whole call of the other signature, and A goes on.  On
main, A then recorded its own trace as the last one after B had recorded
B's step, and the report paired B's step with A's prediction for good.
"""

import sys
import threading

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.tf2.function import PartitionedFunction

CALL = PartitionedFunction.__call__.__code__


def _step(w):
    def step(x):
        h = x
        for _ in range(3 if x.shape[0] > 8 else 1):  # two signatures, two plans
            h = tf.tanh(h @ w) * 0.5 + h
        return tf.reduce_sum(h)
    return step


def test_memory_report_pairs_the_step_with_the_plan_that_ran_it():
    w = tf.Variable(np.random.RandomState(0).randn(32, 32).astype(np.float32) * 0.1)
    fn = tfmem.function(_step(w), partition_size=2)
    small, large = tf.ones((4, 32)), tf.ones((16, 32))
    fn(small)  # both traced and compiled before the threads run
    fn(large)
    predicted = {}
    for name, x in (("small", small), ("large", large)):
        fn(x)
        predicted[name] = (fn.last_step.partitions, fn.memory_report().predicted_device_peak)
    assert predicted["small"] != predicted["large"], predicted
    before = fn.last_step
    paused, b_done = threading.Event(), threading.Event()

    def pause_after_publishing(frame, event, arg):
        if event == "line" and not paused.is_set() and fn.last_step is not before:
            paused.set()  # A's step is the last one now: let B run a whole call
            assert b_done.wait(60), "thread B never finished"
        return pause_after_publishing

    def calls(frame, event, arg):
        return pause_after_publishing if frame.f_code is CALL else None

    def thread_a():
        sys.settrace(calls)
        try:
            fn(small)
        finally:
            sys.settrace(None)

    def thread_b():
        fn(large)
        b_done.set()

    a = threading.Thread(target=thread_a, name="A")
    a.start()
    assert paused.wait(60), "thread A never published its step"
    b = threading.Thread(target=thread_b, name="B")
    b.start()
    b.join(60)
    a.join(60)
    assert not a.is_alive() and not b.is_alive()
    report = fn.memory_report()
    which = "large" if fn.last_step.partitions == predicted["large"][0] else "small"
    assert (fn.last_step.partitions, report.predicted_device_peak) == predicted[which]
    assert len(report.predicted_partition_peaks) == fn.last_step.partitions
