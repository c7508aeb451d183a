"""The placement pass: state to the host when the session has an accelerator."""

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.analyse import analyse
from tfmem.place import HOST_DEVICE, place

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


def test_accelerator_session_moves_large_constants_and_reports_variables():
    g, x, loss, train, _ = _gpu_graph()
    placement = place(_view(g, [loss], [x]), accelerator="GPU:0")
    assert dict(placement.moved) == {"model/table": HOST_DEVICE}
    assert set(placement.stays) == {"model/w"}
    assert "/device:GPU:0" in placement.stays["model/w"]
    assert "state_on_host" in placement.stays["model/w"]


def test_state_on_host_puts_variables_and_large_constants_on_the_host():
    g, x, loss, _, _ = _gpu_graph(state_on_host=True)
    assert "CPU" in g.get_operation_by_name("w").device
    assert "CPU" in g.get_operation_by_name("table").device
    assert "GPU" in g.get_operation_by_name("small").device
    placement = place(_view(g, [loss], [x]), accelerator="GPU:0")
    assert not placement.moved and not placement.stays


def test_cpu_only_session_has_nothing_to_move_and_says_so():
    g, x, loss, train, init = _gpu_graph()
    sess = tf1.Session(graph=g, config=tf1.ConfigProto(allow_soft_placement=True))
    tfs = tfmem.TFMemSession(sess, partition_size=3)
    plan = tfs.plan([train, loss], {x: np.ones((2, 4))})
    assert plan.placement.accelerator is None
    assert not plan.placement.moved and not plan.placement.stays
    assert "nothing to move" in str(plan.placement)
    assert "nothing to move" in str(plan)


def test_moved_constants_are_read_from_host_copies_with_the_same_result():
    """Rewrite with a placement that moves a constant: results match plain."""
    g, x, loss, train, init = _gpu_graph()
    config = tf1.ConfigProto(allow_soft_placement=True)
    plain, wrapped = tf1.Session(graph=g, config=config), tf1.Session(graph=g, config=config)
    plain.run(init)
    tfs = tfmem.TFMemSession(wrapped, partition_size=3)
    tfs.run(init)
    tfs._accelerator = "GPU:0"  # pylint: disable=protected-access; plan as on a GPU session
    feed = {x: np.arange(8, dtype=np.float32).reshape(2, 4)}
    plan = tfs.plan([train, loss], feed)
    assert dict(plan.placement.moved) == {"model/table": HOST_DEVICE}
    tfmem.validate(plan)
    for _ in range(3):
        np.testing.assert_allclose(tfs.run([train, loss], feed)[1],
                                   plain.run([train, loss], feed)[1], rtol=1e-5)
    host_copies = [op for op in g.get_operations()
                   if op.name.startswith("tfmem/") and op.name.endswith("/host/model/table")]
    assert len(host_copies) == 1 and host_copies[0].device == HOST_DEVICE
