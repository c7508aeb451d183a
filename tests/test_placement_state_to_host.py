"""The placement pass: state to the host when the session has an accelerator."""

import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.plan.analyse import analyse
from tfmem.plan.place import HOST_DEVICE, place
from tfmem.run.placement.placement_pass import Record
from tfmem.plan.build import make_plan

tf1 = tf.compat.v1
BIG = (512, 1024)  # 2 MiB of float32, above the 1 MiB default threshold


def _gpu_graph(state_on_host=False):
    """A training graph that targets the GPU, as a user's script would."""
    g = tf.Graph()
    with g.as_default(), tf.device("/device:GPU:0"):
        scope = tfmem.state_on_host() if state_on_host else tf1.variable_scope("model")
        with scope:
            w = tf1.get_variable("w", [4, 4], initializer=tf1.glorot_uniform_initializer(seed=1))
            table = tf.constant(np.ones(BIG, np.float32), name="table")
            small = tf.constant(np.ones((4,), np.float32), name="small")
        x = tf1.placeholder(tf.float32, [2, 4], name="x")
        loss = tf.reduce_sum(tf.matmul(x, w) * small) + tf.reduce_sum(table)
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, x, loss, train, init


def _view(g, fetches, feeds):
    with g.as_default():
        return analyse([g.as_graph_element(f) for f in fetches], [], feeds)


def test_planned_without_a_session_the_placement_predicts_what_the_pass_moves():
    g, x, loss, train, _ = _gpu_graph()
    placement = place(_view(g, [loss], [x]), accelerator="GPU:0")
    assert dict(placement.moved) == {"model/w": HOST_DEVICE, "model/table": HOST_DEVICE}
    assert placement.moved_bytes == 4 * 4 * 4 + BIG[0] * BIG[1] * 4
    assert placement.predicted and "would move 2 state ops" in str(placement)
    assert not placement.stays and not placement.copied


def test_with_the_pass_outcome_what_stayed_is_listed_and_large_constants_copied():
    g, x, loss, train, _ = _gpu_graph()
    outcome = Record()
    outcome.stays.update({"model/w": "why w stays", "model/table": "why the table stays"})
    view = _view(g, [loss], [x])
    placement = place(view, accelerator="GPU:0", outcome=outcome)
    assert not placement.moved and not placement.predicted
    assert dict(placement.stays) == outcome.stays
    assert dict(placement.copied) == {"model/table": HOST_DEVICE}
    assert "why w stays" in str(placement)
    outcome = Record()
    outcome.moved.update({"model/w": 64, "model/table": BIG[0] * BIG[1] * 4})
    placement = place(view, accelerator="GPU:0", outcome=outcome)
    assert set(placement.moved) == {"model/w", "model/table"} and not placement.stays


def test_validate_refuses_a_host_copy_of_what_is_not_a_constant():
    g, x, loss, train, _ = _gpu_graph()
    with g.as_default():
        plan = make_plan(analyse([loss], [], [x]), 3, accelerator="GPU:0")
    bad = dataclasses.replace(plan, placement=dataclasses.replace(
        plan.placement, copied=types.MappingProxyType({"model/w": HOST_DEVICE})))
    with pytest.raises(tfmem.InvalidPlanError, match="copies 'model/w'"):
        tfmem.validate(bad)


def test_state_on_host_puts_variables_and_large_constants_on_the_host():
    g, x, loss, _, _ = _gpu_graph(state_on_host=True)
    assert "CPU" in g.get_operation_by_name("w").device
    assert "CPU" in g.get_operation_by_name("table").device
    assert "GPU" in g.get_operation_by_name("small").device
    placement = place(_view(g, [loss], [x]), accelerator="GPU:0")
    assert not placement.stays and not placement.copied
    assert set(placement.moved) == set()  # already on the host: nothing to move


def test_cpu_only_session_has_nothing_to_move_and_says_so():
    g, x, loss, train, init = _gpu_graph()
    sess = tf1.Session(graph=g, config=tf1.ConfigProto(allow_soft_placement=True))
    tfs = tfmem.TFMemSession(sess, partition_size=3)
    plan = tfs.plan([train, loss], {x: np.ones((2, 4))})
    assert plan.placement.accelerator is None
    assert not plan.placement.moved and not plan.placement.stays
    assert "nothing to move" in str(plan.placement)
    assert "nothing to move" in str(plan)
