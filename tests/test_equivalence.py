"""Training and state: partitioned runs equal plain Session.run runs.

The training tests run both ways (`both_memories`): as if the session had an
accelerator's own memory, where swap="auto" swaps tensors whose next reader
is far, and on the real CPU default, where it swaps nothing.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import (
    ATOL,
    RTOL,
    assert_same_result,
    both_memories,
    build_convnet,
    build_mlp,
    check_plan,
    new_session,
)

tf1 = tf.compat.v1


def _train(run, model, steps):
    """Run ``steps`` training steps with ``run``; return losses and final weights."""
    losses = []
    for step in range(steps):
        _, loss = run([model.train, model.loss], feed_dict=model.data[step % len(model.data)])
        losses.append(loss)
    return np.array(losses), run(model.weights)


# swap="auto" settings under which these tiny models swap their far tensors
AUTO_SWAPS = dict(swap="auto", swap_distance=1, options=tfmem.Options(swap_min_bytes=0))


def _plain_and_wrapped(build, partition_size, **kwargs):
    """Build the model twice: one plain session, one TFMemSession."""
    plain_model, wrapped_model = build(**kwargs), build(**kwargs)
    plain = new_session(plain_model.graph)
    tfs = tfmem.TFMemSession(new_session(wrapped_model.graph), partition_size=partition_size,
                             **AUTO_SWAPS)
    plain.run(plain_model.init)
    tfs.run(wrapped_model.init)
    return plain_model, plain, wrapped_model, tfs


def _check_swapping(plan, device_memory):
    """On accelerator memory "auto" swaps far tensors; on the CPU default nothing."""
    swapped = [t.tensor for t in plan.transfers if t.swapped]
    if device_memory == "accelerator":
        assert plan.policy.mode == "auto" and swapped, (plan.policy, swapped)
    else:
        assert plan.policy.mode == "none" and not swapped, (plan.policy, swapped)


@both_memories
@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
@pytest.mark.parametrize("partition_size", [3, 7])
def test_mlp_training_matches_plain(optimizer, use_resource, partition_size, device_memory):
    pm, plain, wm, tfs = _plain_and_wrapped(build_mlp, partition_size, optimizer=optimizer, use_resource=use_resource)
    try:
        plan = tfs.plan([wm.train, wm.loss], feed_dict=wm.data[0])
        assert len(plan.partitions) > 1
        check_plan(plan, wm.graph, partition_size)
        _check_swapping(plan, device_memory)

        exp_losses, exp_w = _train(plain.run, pm, 4)
        got_losses, got_w = _train(tfs.run, wm, 4)
        np.testing.assert_allclose(got_losses, exp_losses, rtol=RTOL, atol=ATOL)
        assert_same_result(exp_w, got_w)
        # training actually moved the weights, so the comparison is not vacuous
        assert not np.allclose(exp_losses[0], exp_losses[-1])
    finally:
        plain.close()
        tfs.close()


@both_memories
def test_mlp_training_partition_size_one(device_memory):
    pm, plain, wm, tfs = _plain_and_wrapped(build_mlp, 1, optimizer="adam", use_resource=True)
    try:
        _check_swapping(tfs.plan([wm.train, wm.loss], feed_dict=wm.data[0]), device_memory)
        exp_losses, exp_w = _train(plain.run, pm, 3)
        got_losses, got_w = _train(tfs.run, wm, 3)
        np.testing.assert_allclose(got_losses, exp_losses, rtol=RTOL, atol=ATOL)
        assert_same_result(exp_w, got_w)
    finally:
        plain.close()
        tfs.close()


def test_adam_slots_and_beta_powers_match_plain():
    """Optimizer state (slots, beta powers) is updated exactly once per step."""
    pm, plain, wm, tfs = _plain_and_wrapped(build_mlp, 5, optimizer="adam", use_resource=True)
    try:
        _train(plain.run, pm, 3)
        _train(tfs.run, wm, 3)
        with pm.graph.as_default():
            pvars = {v.op.name: v for v in tf1.global_variables()}
        with wm.graph.as_default():
            wvars = {v.op.name: v for v in tf1.global_variables()}
        assert sorted(pvars) == sorted(wvars)
        assert any("beta1_power" in n for n in pvars)
        assert any("/Adam" in n for n in pvars)  # slot variables
        assert_same_result(plain.run(pvars), tfs.run(wvars))
    finally:
        plain.close()
        tfs.close()


@both_memories
@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
@pytest.mark.parametrize("partition_size", [2, 5])
def test_convnet_moving_averages_once_per_step(use_resource, partition_size, device_memory):
    pm, plain, wm, tfs = _plain_and_wrapped(build_convnet, partition_size, use_resource=use_resource)
    try:
        plan = tfs.plan([wm.train, wm.loss], feed_dict=wm.data[0])
        assert len(plan.partitions) > 1
        check_plan(plan, wm.graph, partition_size)
        _check_swapping(plan, device_memory)
        steps = 4
        exp_losses, exp_w = _train(plain.run, pm, steps)
        got_losses, got_w = _train(tfs.run, wm, steps)
        np.testing.assert_allclose(got_losses, exp_losses, rtol=RTOL, atol=ATOL)
        assert_same_result(exp_w, got_w)
        exp_moving, exp_steps = plain.run([pm.moving, pm.steps])
        got_moving, got_steps = tfs.run([wm.moving, wm.steps])
        assert exp_steps == steps
        assert got_steps == exp_steps
        assert_same_result(exp_moving, got_moving)
        # the same through the plain session that tfs wraps
        assert_same_result(exp_moving, tfs.session.run(wm.moving))
    finally:
        plain.close()
        tfs.close()


@both_memories
@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_plain_session_between_wrapped_runs(use_resource, device_memory):
    """State is shared: alternate sess.run and tfs.run on one session."""
    ref_model, mixed_model = build_mlp("momentum", use_resource), build_mlp("momentum", use_resource)
    ref = new_session(ref_model.graph)
    sess = new_session(mixed_model.graph)
    tfs = tfmem.TFMemSession(sess, partition_size=4, **AUTO_SWAPS)
    try:
        _check_swapping(tfs.plan([mixed_model.train, mixed_model.loss],
                                 feed_dict=mixed_model.data[0]), device_memory)
        assert tfs.session is sess
        assert tfs.graph is mixed_model.graph
        ref.run(ref_model.init)
        sess.run(mixed_model.init)
        exp, got = [], []
        for step in range(5):
            feed_ref = ref_model.data[step]
            feed_mixed = mixed_model.data[step]
            exp.append(ref.run([ref_model.train, ref_model.loss], feed_dict=feed_ref)[1])
            runner = tfs.run if step % 2 else sess.run
            got.append(runner([mixed_model.train, mixed_model.loss], feed_dict=feed_mixed)[1])
        np.testing.assert_allclose(got, exp, rtol=RTOL, atol=ATOL)
        assert_same_result(ref.run(ref_model.weights), sess.run(mixed_model.weights))
        assert_same_result(ref.run(ref_model.weights), tfs.run(mixed_model.weights))
    finally:
        ref.close()
        tfs.close()


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_variable_read_after_write_in_one_step(use_resource, pair):
    """Control dependencies order a write before a read in a later partition."""
    g = tf.Graph()
    with g.as_default():
        v = tf1.Variable(np.arange(3, dtype=np.float32), use_resource=use_resource, name="v")
        inc = tf1.assign_add(v, [1.0, 2.0, 3.0])
        with tf.control_dependencies([inc]):
            r = tf.identity(v.read_value())
        out = r
        for _ in range(6):
            out = out * 1.5 - 0.25
        init = tf1.global_variables_initializer()
    plain, tfs = pair(g, 2, init)
    assert len(tfs.plan(out).partitions) > 1
    for _ in range(3):
        assert_same_result(plain.run(out), tfs.run(out))
    assert_same_result(plain.run(v), tfs.run(v))


@pytest.mark.parametrize("partition_size", [1, 2, 3])
def test_stateful_random_sampled_once(partition_size, pair):
    g = tf.Graph()
    with g.as_default():
        r = tf.random.normal([5], seed=1)
        a = r
        for i in range(6):
            a = tf.identity(a, name=f"chain{i}")
        a = a * 2.0
        b = r + 1.0
    _, tfs = pair(g, partition_size)
    plan = tfs.plan([a, b])
    assert len(plan.partitions) > 1
    check_plan(plan, g, partition_size)
    rv, av, bv = tfs.run([r, a, b])
    np.testing.assert_array_equal(av, rv * 2.0)
    np.testing.assert_array_equal(bv, rv + 1.0)
    # without fetching r itself
    av, bv = tfs.run([a, b])
    np.testing.assert_allclose(av / 2.0, bv - 1.0, rtol=1e-6, atol=1e-6)
    # and successive runs draw new samples
    av2, _ = tfs.run([a, b])
    assert not np.array_equal(av, av2)


def test_random_sequence_matches_plain_across_requests(pair):
    """A stateful random op keeps one state per session, whatever is fetched.

    Plain Session.run draws the next sample on every run, also when the
    requests differ; the wrapped session must not restart the sequence for a
    new request.
    """
    g = tf.Graph()
    with g.as_default():
        r = tf.random.uniform([4], seed=7)
        a = r
        for _ in range(4):
            a = a * 1.0 + 0.0
        b = tf.reduce_sum(r)
    plain, tfs = pair(g, 2)
    requests = [[r, a], [r, b], [r], [r, a], [r, b]]
    exp = [plain.run(f)[0] for f in requests]
    got = [tfs.run(f)[0] for f in requests]
    assert len({v.tobytes() for v in exp}) == len(exp)
    assert_same_result(exp, got)


def test_dataset_iterator_advances_once_per_run(pair):
    g = tf.Graph()
    with g.as_default():
        ds = tf.data.Dataset.range(20)
        it = tf1.data.make_one_shot_iterator(ds)
        nxt = it.get_next()
        y = nxt
        for _ in range(5):
            y = y * 2 + 1
        z = nxt + 100
    plain, tfs = pair(g, 2)
    plan = tfs.plan([nxt, y, z])
    assert len(plan.partitions) > 1
    check_plan(plan, g, 2)

    def expect(n):
        v = n
        for _ in range(5):
            v = v * 2 + 1
        return v

    for n in range(3):
        got_n, got_y, got_z = tfs.run([nxt, y, z])
        assert got_n == n
        assert got_y == expect(n)
        assert got_z == n + 100
    # the plain session that tfs wraps continues the same iterator
    assert tfs.session.run(nxt) == 3
    got_n, got_y = tfs.run([nxt, y])
    assert (got_n, got_y) == (4, expect(4))
    # fetching only a derived value still advances exactly once
    assert tfs.run(z) == 105
    assert tfs.run(nxt) == 6
    # a separate plain session has its own iterator, untouched
    assert plain.run(nxt) == 0


def test_string_and_int_tensors_cross_partitions(pair):
    g = tf.Graph()
    with g.as_default():
        words = tf1.placeholder(tf.string, [None], name="words")
        s = tf.strings.join([words, tf.constant("-x")])
        s = tf.strings.upper(s)
        s = tf.strings.join([s, s], separator="|")
        lengths = tf.strings.length(s)
        ints = tf.range(10, dtype=tf.int64)
        ints = tf.cumsum(ints) * 3
        ints = tf.math.floormod(ints, 7)
        total = tf.reduce_sum(tf.cast(lengths, tf.int64)) + tf.reduce_sum(ints)
        i32 = tf.cast(total, tf.int32) // 2
        u8 = tf.cast(tf.math.floormod(ints, 200), tf.uint8) + tf.constant(1, tf.uint8)
        flag = tf.logical_not(tf.equal(ints, 3))
        joined = tf.strings.reduce_join(s, separator=",")
    plain, tfs = pair(g, 2)
    fetches = [s, lengths, ints, total, i32, u8, flag, joined]
    feed = {words: np.array([b"ab", b"", "\u00e9t\u00e9".encode()], dtype=object)}
    plan = tfs.plan(fetches, feed_dict=feed)
    assert len(plan.partitions) > 1
    check_plan(plan, g, 2)
    crossing = {t.tensor for t in plan.transfers}
    dtypes = {g.get_tensor_by_name(name).dtype for name in crossing}
    assert tf.string in dtypes and tf.int64 in dtypes
    assert_same_result(plain.run(fetches, feed_dict=feed), tfs.run(fetches, feed_dict=feed))


def test_feed_intermediate_tensor(pair):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [3], name="x")
        counter = tf1.Variable(0.0, use_resource=True, name="counter")
        bump = counter.assign_add(1.0)
        with tf.control_dependencies([bump]):
            h = tf.identity(x * 2.0, name="h")
        y = h
        for _ in range(5):
            y = tf.sin(y) + h
        init = tf1.global_variables_initializer()
    plain, tfs = pair(g, 2, init)
    hv = np.array([0.5, -1.0, 2.0], np.float32)
    xv = np.array([1.0, 2.0, 3.0], np.float32)
    plan = tfs.plan(y, feed_dict={h: hv})
    assert len(plan.partitions) > 1
    all_ops = {n for p in plan.partitions for n in p.ops}
    assert "h" not in all_ops and "x" not in all_ops
    check_plan(plan, g, 2)
    # feeding h cuts everything upstream of it, including the counter bump
    assert_same_result(plain.run([y, h], feed_dict={h: hv}), tfs.run([y, h], feed_dict={h: hv}))
    assert_same_result(plain.run(counter), tfs.run(counter))
    assert tfs.run(counter) == 0.0
    # without the intermediate feed, x is needed and the bump runs once
    assert_same_result(plain.run(y, feed_dict={x: xv}), tfs.run(y, feed_dict={x: xv}))
    assert tfs.run(counter) == 1.0


def test_hash_table_lookup_crosses_partitions(pair):
    """A table (state source) initialised through the wrapper, read in several partitions."""
    g = tf.Graph()
    with g.as_default():
        keys = tf.constant(["a", "b", "c"])
        vals = tf.constant([1, 2, 3], tf.int64)
        table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(keys, vals), default_value=-1)
        words = tf1.placeholder(tf.string, [None], name="words")
        ids = table.lookup(words)
        out = ids
        for _ in range(4):
            out = out * 2 + 1
        again = table.lookup(tf.strings.upper(words)) + out
        init = tf1.tables_initializer()
    plain, tfs = pair(g, 2, init)
    feed = {words: np.array([b"a", b"z", b"c", b"A"], dtype=object)}
    assert len(tfs.plan([out, again], feed_dict=feed).partitions) > 1
    assert_same_result(plain.run([ids, out, again], feed_dict=feed), tfs.run([ids, out, again], feed_dict=feed))


def test_fifo_queue_dequeues_once_per_run(pair):
    g = tf.Graph()
    with g.as_default():
        q = tf1.FIFOQueue(20, tf.float32, shapes=[2])
        enq = q.enqueue_many(tf.reshape(tf.range(20, dtype=tf.float32), [10, 2]))
        item = q.dequeue()
        out = item
        for _ in range(4):
            out = out * 3.0 - 1.0
        other = item + 100.0
        size = q.size()
    plain, tfs = pair(g, 2)
    plain.run(enq)
    tfs.run(enq)
    assert len(tfs.plan([out, other]).partitions) > 1
    for _ in range(3):
        assert_same_result(plain.run([item, out, other]), tfs.run([item, out, other]))
        assert_same_result(plain.run(out), tfs.run(out))
    assert_same_result(plain.run(size), tfs.run(size))
