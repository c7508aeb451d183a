"""The placement pass on a session with two CPU devices, CPU:1 standing in for the accelerator.

The user's graph targets CPU:1 as a script would target a GPU.  After the pass,
TensorFlow's own placement (the partition graphs of a run) shows the variables,
their initializers and updates on CPU:0 and the model's compute on CPU:1; a
few training steps equal those of the same graph run plainly, unmoved.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.place import HOST_DEVICE

tf1 = tf.compat.v1
ACCELERATOR = "/device:CPU:1"
MIN_BYTES = 8 << 10  # the large constant below is 16 KiB
UPDATES = ("ApplyMomentum", "ResourceApplyMomentum", "ApplyAdam", "ResourceApplyAdam",
           "Assign", "AssignVariableOp", "AssignAdd", "AssignVariableOp")
STATE = ("VarHandleOp", "VariableV2") + UPDATES
COMPUTE = ("MatMul", "Tanh")


def two_cpu_session(graph):
    config = tf1.ConfigProto(device_count={"CPU": 2}, intra_op_parallelism_threads=1,
                             inter_op_parallelism_threads=2)
    return tf1.Session(graph=graph, config=config)


def build(optimizer="momentum", use_resource=True, colocated=False):
    """A small training graph on the 'accelerator'; numpy-initialised so two builds agree."""
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default(), tf.device(ACCELERATOR):
        def variable(name, shape):
            return tf1.get_variable(name, initializer=rs.randn(*shape).astype(np.float32) * 0.3,
                                    use_resource=use_resource)
        x = tf1.placeholder(tf.float32, [8, 16], name="x")
        w1 = variable("w1", [16, 64])
        table = tf.constant(rs.randn(64, 64).astype(np.float32) * 0.1, name="table")  # 16 KiB
        scale = tf.constant(rs.randn(64).astype(np.float32), name="scale")  # small: stays
        if colocated:
            with g.colocate_with(w1.op):
                w2 = variable("w2", [64, 4])
        else:
            w2 = variable("w2", [64, 4])
        h = tf.tanh(tf.matmul(tf.matmul(x, w1), table) * scale)
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w2)))
        opt = (tf1.train.MomentumOptimizer(0.05, 0.9) if optimizer == "momentum"
               else tf1.train.AdamOptimizer(0.01))
        train = opt.minimize(loss)
        init = tf1.global_variables_initializer()
    return g, x, loss, train, init


def batches(steps):
    rs = np.random.RandomState(1)
    return [rs.randn(8, 16).astype(np.float32) for _ in range(steps)]


def placed(run, *args, **kwargs):
    """{op type: set of devices} TensorFlow ran the request's ops on (partition graphs)."""
    metadata = tf1.RunMetadata()
    result = run(*args, options=tf1.RunOptions(output_partition_graphs=True),
                 run_metadata=metadata, **kwargs)
    devices = {}
    for partition in metadata.partition_graphs:
        for node in partition.node:
            devices.setdefault(node.op, set()).add(node.device.rsplit("/", 1)[-1])
    return result, devices


def assert_state_on_host(devices):
    state = {t: d for t, d in devices.items() if t in STATE}
    assert state and any(t in UPDATES for t in state), devices
    assert all(d == {"device:CPU:0"} for d in state.values()), state
    for kind in COMPUTE:
        assert devices[kind] == {"device:CPU:1"}, devices


@pytest.mark.parametrize("optimizer,use_resource,colocated", [
    ("momentum", True, False), ("adam", False, False), ("adam", True, True),
    ("momentum", False, True)])
def test_pass_moves_state_and_training_matches_plain(optimizer, use_resource, colocated, caplog):
    g_plain, x_plain, loss_plain, train_plain, init_plain = build(optimizer, use_resource,
                                                                  colocated)
    g, x, loss, train, init = build(optimizer, use_resource, colocated)
    plain = two_cpu_session(g_plain)
    with caplog.at_level(logging.INFO, logger="tfmem.placement_pass"):
        tfs = tfmem.TFMemSession(two_cpu_session(g), partition_size=4, swap_min_bytes=MIN_BYTES,
                                 accelerator_device="CPU:1")
    moved_lines = [r for r in caplog.records if r.name == "tfmem.placement_pass"]
    assert len(moved_lines) == 1 and "MiB" in moved_lines[0].getMessage()
    variables = {op.name for op in g.get_operations() if op.type in ("VarHandleOp", "VariableV2")}
    assert variables >= {"w1", "w2"} and len(variables) > 2  # slots too
    for name in variables | {"table"}:
        assert g.get_operation_by_name(name).device == HOST_DEVICE, name
    assert g.get_operation_by_name("scale").device == ACCELERATOR
    assert g.get_operation_by_name("MatMul").device == ACCELERATOR

    plain.run(init_plain)
    _, init_devices = placed(tfs.run, init)
    assert init_devices.keys() & {"Assign", "AssignVariableOp"}
    assert all(d == {"device:CPU:0"} for t, d in init_devices.items()
               if t in ("Assign", "AssignVariableOp", "VarHandleOp", "VariableV2")), init_devices

    plan = tfs.plan([train, loss], {x: batches(1)[0]})
    assert set(plan.placement.moved) >= {"w1", "w2", "table"} and not plan.placement.stays
    assert "scale" not in plan.placement.moved
    assert plan.placement.moved_bytes >= (16 * 64 + 64 * 4 + 64 * 64) * 4
    for step, batch in enumerate(batches(4)):
        expected = plain.run([train_plain, loss_plain], {x_plain: batch})[1]
        (_, got), devices = placed(tfs.run, [train, loss], {x: batch})
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=f"step {step}")
        assert_state_on_host(devices)
    # The plain session of the same graph sees the same placement.
    _, devices = placed(tfs.session.run, [train, loss], {x: batches(1)[0]})
    assert_state_on_host(devices)
    _, plain_devices = placed(plain.run, train_plain, {x_plain: batches(1)[0]})
    updates = [d for t, d in plain_devices.items() if t.startswith(("Apply", "ResourceApply"))]
    assert updates and all(d == {"device:CPU:1"} for d in updates), plain_devices
    with g_plain.as_default():
        plain_values = plain.run(tf1.trainable_variables())
    with g.as_default():
        values = tfs.session.run(tf1.trainable_variables())
    for got, expected in zip(values, plain_values):
        np.testing.assert_allclose(got, expected, rtol=1e-5)
