"""Kernel scratch of ops that may run at once (tfmem.memory.concurrency).

TensorFlow's CPU executor runs ready ops on its inter-op threads, so two ops with
no path between them may hold their kernel scratch at the same time; with more
than one thread the simulator adds the largest such scratch to each op's.
"""

import tensorflow as tf

from tfmem.memory.concurrency import overlapping_scratch
from tfmem.plan.analyse import analyse

tf1 = tf.compat.v1


def _diamond():
    """x -> a, b, d (independent); c reads a and b; e reads c and d."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        a = tf.sin(x, name="a")
        b = tf.cos(x, name="b")
        d = tf.tanh(x, name="d")
        c = tf.add(a, b, name="c")
        e = tf.multiply(c, d, name="e")
    view = analyse([e], [], [x])
    return view, ["a", "b", "d", "c", "e"]


def test_ops_with_a_path_between_them_never_overlap():
    view, order = _diamond()
    scratch = {"a": 10, "b": 7, "c": 5, "d": 3}
    # c runs after a and b: only d may run beside it; a, b and d beside each other
    assert overlapping_scratch(view, order, scratch, 2) == {"a": 7, "b": 10, "d": 10, "c": 3}
    # three at once: the two largest others
    assert overlapping_scratch(view, order, scratch, 3) == {"a": 10, "b": 13, "d": 17, "c": 3}


def test_one_thread_runs_one_kernel_at_a_time():
    view, order = _diamond()
    assert overlapping_scratch(view, order, {"a": 10, "b": 7}, 1) == {}
    assert overlapping_scratch(view, order, {"a": 10}, 2) == {}  # nothing beside it
