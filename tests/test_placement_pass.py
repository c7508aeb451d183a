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
from tfmem.run.compiling.colocation import colocation_groups
from tfmem.plan.place import HOST_DEVICE

tf1 = tf.compat.v1
ACCELERATOR = "/device:CPU:1"
MIN_BYTES = 8 << 10  # the large constant below is 16 KiB
UPDATES = ("ApplyMomentum", "ResourceApplyMomentum", "ApplyAdam", "ResourceApplyAdam",
           "Assign", "AssignVariableOp", "AssignAdd", "AssignAddVariableOp")
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


def _unrewritten(op_type):
    """The op type before oneDNN's graph rewrite, which runs MatMul as _MklMatMul (a
    partition graph shows the rewritten type)."""
    return op_type.removeprefix("_Mkl").removeprefix("Native")


def placed(run, *args, by="op", **kwargs):
    """{op type (or node name, by="name"): set of devices} TensorFlow ran the request's
    ops on, from the run's partition graphs."""
    metadata = tf1.RunMetadata()
    result = run(*args, options=tf1.RunOptions(output_partition_graphs=True),
                 run_metadata=metadata, **kwargs)
    devices = {}
    for partition in metadata.partition_graphs:
        for node in partition.node:
            key = _unrewritten(node.op) if by == "op" else node.name
            devices.setdefault(key, set()).add(node.device.rsplit("/", 1)[-1])
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
    with caplog.at_level(logging.INFO, logger="tfmem.run.placement.placement_pass"):
        tfs = tfmem.TFMemSession(two_cpu_session(g), partition_size=4,
                                 options=tfmem.Options(swap_min_bytes=MIN_BYTES,
                                                       accelerator_device="CPU:1"))
    moved_lines = [r for r in caplog.records if r.name == "tfmem.run.placement.placement_pass"]
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


def _devices(graph):
    return {op.name: op.device for op in graph.get_operations()}


@pytest.mark.parametrize("first_run", ["init", "unrelated"])
def test_after_a_run_nothing_moves_and_the_placement_says_why(first_run, caplog):
    """TensorFlow ignores a device set after any run; the pass leaves the graph as it was."""
    g_plain, x_plain, loss_plain, train_plain, init_plain = build()
    g, x, loss, train, init = build()
    with g.as_default():
        unrelated = tf.constant(1.0, name="unrelated")
    sess = two_cpu_session(g)
    sess.run(init if first_run == "init" else unrelated)
    before = _devices(g)
    with caplog.at_level(logging.INFO, logger="tfmem.run.placement.placement_pass"):
        tfs = tfmem.TFMemSession(sess, partition_size=4,
                                 options=tfmem.Options(swap_min_bytes=MIN_BYTES,
                                                       accelerator_device="CPU:1"))
    after = _devices(g)
    assert {k: v for k, v in after.items() if k in before} == before
    warnings = [r for r in caplog.records
                if r.name == "tfmem.run.placement.placement_pass" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "before its first run" in warnings[0].getMessage()
    assert "state_on_host" in warnings[0].getMessage()
    assert not any(r.levelno == logging.INFO and "moved" in r.getMessage()
                   for r in caplog.records if r.name == "tfmem.run.placement.placement_pass")

    if first_run == "unrelated":
        tfs.run(init)
    plain = two_cpu_session(g_plain)
    plain.run(init_plain)
    plan = tfs.plan([train, loss], {x: batches(1)[0]})
    assert not plan.placement.moved
    assert {"w1", "w2", "table"} <= set(plan.placement.stays)
    assert all("already placed it on" in why and "CPU:1" in why
               for why in plan.placement.stays.values()), plan.placement.stays
    assert dict(plan.placement.copied) == {"table": HOST_DEVICE}
    assert "stay on the accelerator" in str(plan)
    for batch in batches(3):
        expected = plain.run([train_plain, loss_plain], {x_plain: batch})[1]
        (_, got), devices = placed(tfs.run, [train, loss], {x: batch})
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        updates = [d for t, d in devices.items() if t.startswith("ResourceApply")]
        assert updates and all(d == {"device:CPU:1"} for d in updates), devices
    _, nodes = placed(tfs.run, [train, loss], {x: batches(1)[0]}, by="name")
    copies = {name: d for name, d in nodes.items() if name.endswith("/host/table")}
    assert copies and all(d == {"device:CPU:0"} for d in copies.values()), nodes
    assert "table" not in nodes  # the accelerator's original is not read


def test_place_state_on_host_false_changes_nothing():
    g, x, loss, train, init = build()
    before = _devices(g)
    tfs = tfmem.TFMemSession(two_cpu_session(g), partition_size=4,
                             options=tfmem.Options(swap_min_bytes=MIN_BYTES,
                                                   accelerator_device="CPU:1",
                                                   place_state_on_host=False))
    assert _devices(g) == before  # no device set, no probe added
    tfs.run(init)
    plan = tfs.plan([train, loss], {x: batches(1)[0]})
    assert not plan.placement.moved and not plan.placement.stays
    assert "nothing to move" in str(plan.placement)
    _, devices = placed(tfs.run, [train, loss], {x: batches(1)[0]})
    assert devices["VarHandleOp"] == {"device:CPU:1"}


def test_state_built_after_wrapping_moves_at_its_first_plan():
    g = tf.Graph()
    with g.as_default(), tf.device(ACCELERATOR):
        x = tf1.placeholder(tf.float32, [2, 3], name="x")
    tfs = tfmem.TFMemSession(two_cpu_session(g), partition_size=2,
                             options=tfmem.Options(accelerator_device="CPU:1"))
    with g.as_default(), tf.device(ACCELERATOR):
        w = tf1.get_variable("w", initializer=np.ones((3, 3), np.float32))
        y = tf.reduce_sum(tf.matmul(x, w))
        init = tf1.global_variables_initializer()
    tfs.run(init)
    assert g.get_operation_by_name("w").device == HOST_DEVICE
    plan = tfs.plan(y, {x: np.ones((2, 3), np.float32)})
    assert dict(plan.placement.moved) == {"w": HOST_DEVICE}
    got, devices = placed(tfs.run, y, {x: np.ones((2, 3), np.float32)})
    assert got == pytest.approx(18.0)
    assert devices["VarHandleOp"] == {"device:CPU:0"} and devices["MatMul"] == {"device:CPU:1"}


def test_a_constant_colocated_with_compute_stays():
    """The pass moves state and constants, never the user's compute."""
    g = tf.Graph()
    with g.as_default(), tf.device(ACCELERATOR):
        x = tf1.placeholder(tf.float32, [64, 64], name="x")
        square = tf.matmul(x, x, name="square")
        with g.colocate_with(square.op):
            big = tf.constant(np.ones((64, 64), np.float32), name="big")
        y = tf.reduce_sum(square + big)
    tfs = tfmem.TFMemSession(two_cpu_session(g), partition_size=2,
                             options=tfmem.Options(swap_min_bytes=MIN_BYTES,
                                                   accelerator_device="CPU:1"))
    assert g.get_operation_by_name("big").device == ACCELERATOR
    assert g.get_operation_by_name("square").device == ACCELERATOR
    plan = tfs.plan(y, {x: np.ones((64, 64), np.float32)})
    assert "square" in plan.placement.stays["big"] and "no compute" in plan.placement.stays["big"]


def test_accelerator_device_must_be_a_session_device():
    g, *_ = build()
    with pytest.raises(ValueError, match="CPU:7.*not a device of the session"):
        tfmem.TFMemSession(two_cpu_session(g), options=tfmem.Options(accelerator_device="CPU:7"))


def test_cpu_only_session_moves_nothing():
    g, x, loss, train, init = build()
    before = _devices(g)
    sess = tf1.Session(graph=g, config=tf1.ConfigProto(allow_soft_placement=True))
    tfs = tfmem.TFMemSession(sess, partition_size=4)
    assert _devices(g) == before
    tfs.run(init)
    assert tfs.plan([train, loss], {x: batches(1)[0]}).placement.accelerator is None


def test_only_what_the_session_has_not_placed_moves():
    """Variables created after the session's last run move; older ones stay, with the reason."""
    rs = np.random.RandomState(2)
    a_value, b_value = rs.randn(3, 4).astype(np.float32), rs.randn(4, 2).astype(np.float32)
    feed_value = rs.randn(2, 3).astype(np.float32)
    g = tf.Graph()
    with g.as_default(), tf.device(ACCELERATOR):
        x = tf1.placeholder(tf.float32, [2, 3], name="x")
        a = tf1.get_variable("a", initializer=a_value)
    sess = two_cpu_session(g)
    sess.run(a.initializer)
    with g.as_default(), tf.device(ACCELERATOR):
        b = tf1.get_variable("b", initializer=b_value)
        y = tf.matmul(tf.matmul(x, a), b)
    tfs = tfmem.TFMemSession(sess, partition_size=1,
                             options=tfmem.Options(accelerator_device="CPU:1"))
    assert g.get_operation_by_name("a").device == ACCELERATOR
    assert g.get_operation_by_name("b").device == HOST_DEVICE
    tfs.run(b.initializer)
    plan = tfs.plan(y, {x: feed_value})
    assert set(plan.placement.moved) == {"b"} and set(plan.placement.stays) == {"a"}
    got, nodes = placed(tfs.run, y, {x: feed_value}, by="name")
    np.testing.assert_allclose(got, sess.run(y, {x: feed_value}), rtol=1e-5)
    assert nodes["a"] == {"device:CPU:1"} and nodes["b"] == {"device:CPU:0"}


def test_a_saver_does_not_tie_variables_together():
    """SaveV2 reads references as values: TensorFlow does not colocate it, nor does the pass,
    so one variable the session already placed does not hold the others back."""
    g = tf.Graph()
    with g.as_default(), tf.device(ACCELERATOR):
        a = tf1.get_variable("a", [2, 2], use_resource=False)
        x = tf1.placeholder(tf.float32, [2, 2], name="x")
    sess = two_cpu_session(g)
    sess.run(a.initializer)
    with g.as_default(), tf.device(ACCELERATOR):
        b = tf1.get_variable("b", [2, 2], use_resource=False)
        y = tf.matmul(tf.matmul(x, a), b)
        tf1.train.Saver([a, b])
    groups = colocation_groups(g)
    assert {"a", "a/read", "a/Assign"} <= groups["a"] and "b" not in groups["a"]
    assert "save/SaveV2" not in groups["a"] | groups["b"]
    tfs = tfmem.TFMemSession(sess, partition_size=2,
                             options=tfmem.Options(accelerator_device="CPU:1"))
    tfs.run(b.initializer)
    plan = tfs.plan(y, {x: np.ones((2, 2), np.float32)})
    assert set(plan.placement.moved) == {"b"} and set(plan.placement.stays) == {"a"}


def test_tfmem_session_moves_state_in_its_copy_and_leaves_the_users_graph_alone():
    """tfmem.Session (its session graph a copy of what runs, see graph_copy): the pass
    moves the copies of the state ops, before the session places them."""
    g_plain, x_plain, loss_plain, train_plain, init_plain = build()
    g, x, loss, train, init = build()
    plain = two_cpu_session(g_plain)
    config = tf1.ConfigProto(device_count={"CPU": 2}, intra_op_parallelism_threads=1,
                             inter_op_parallelism_threads=2)
    tfs = tfmem.Session(graph=g, config=config, partition_size=4,
                        options=tfmem.Options(swap_min_bytes=MIN_BYTES,
                                              accelerator_device="CPU:1"))
    try:
        plain.run(init_plain)
        tfs.run(init)
        for step, batch in enumerate(batches(3)):
            expected = plain.run([train_plain, loss_plain], {x_plain: batch})[1]
            (_, got), devices = placed(tfs.run, [train, loss], {x: batch})
            np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=f"step {step}")
            assert_state_on_host(devices)
        state = [op for op in g.get_operations() if op.type in STATE]
        assert state and all(op.device == ACCELERATOR for op in state)
        for name in ("w1", "w2", "table"):
            assert tfs.session.graph.get_operation_by_name(name).device == HOST_DEVICE
    finally:
        tfs.close()
        plain.close()
