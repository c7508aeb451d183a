"""Ops only control edges need: the plan leaves them out but keeps what they order.

A stateless op whose output nobody reads, there only as a control input, computes
nothing a fetch can see, so analysis drops it; its own inputs must then order its
control readers instead.  Here the only path from the fetched read to the update
that must come first runs through such an op: without the edges passed on, the
update would not even be part of the request, and the read would see the old value.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem

tf1 = tf.compat.v1


def _graph(chain):
    """A variable bumped by an update that reaches the fetched read only through
    `chain` stateless ops used as control inputs."""
    graph = tf.Graph()
    with graph.as_default():
        v = tf1.get_variable("v", [4], initializer=tf1.zeros_initializer(), use_resource=True)
        bump = v.assign_add(tf.ones([4]), read_value=True)
        gate = bump
        for i in range(chain):
            with tf.control_dependencies([gate]):
                gate = tf.identity(tf.ones([4]), name=f"gate{i}")
        with tf.control_dependencies([gate.op]):
            seen = tf.identity(v.read_value(), name="seen") * 2.0
    return graph, v, seen


@pytest.mark.parametrize("chain", [1, 3])
@pytest.mark.parametrize("partition_size", [1, 200])
def test_an_update_ordered_through_dropped_ops_still_runs_first(sessions, chain,
                                                                partition_size):
    results = []
    for wrap in (False, True):
        graph, v, seen = _graph(chain)
        sess = sessions(graph)
        sess.run(v.initializer)
        runner = tfmem.TFMemSession(sess, partition_size=partition_size) if wrap else sess
        results.append([runner.run(seen) for _ in range(2)])
    plain, partitioned = results
    assert np.array_equal(plain[0], np.full(4, 2.0)), plain  # the premise: it ran first
    for a, b in zip(plain, partitioned):
        np.testing.assert_array_equal(a, b)
