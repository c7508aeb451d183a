"""Random streams: one stream per random op, shared by every plan and the plain session.

In plain TensorFlow a stateful random op draws the next numbers of one stream
per op on every `Session.run`, whatever the request.  tfmem must give the same
numbers for any interleaving of wrapped requests (different fetches, feed
shapes, plans) and plain `sess.run` calls on the same session.

The comparison: one graph, two sessions.  Session A runs a drawn sequence of
calls, some through `TFMemSession`, some plainly; session B runs the same
calls plainly.  Both are seeded alike (graph and op seeds are attributes of
the graph), so every call must return the same values.  Unseeded ops get a
random kernel seed per session and cannot be compared: for them the drawn
samples must at least never repeat across plans and plain calls.
"""

import dataclasses
import types

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tfmem
from conftest import assert_same_result, new_session

tf1 = tf.compat.v1

WIDTH = 12
LAYERS = 4
SEEDINGS = ("graph+op", "op", "graph", "none")


def _seeds(seeding, op_seed):
    """(graph seed, op seed) for a seeding mode."""
    return {"graph+op": (99, op_seed), "op": (None, op_seed),
            "graph": (99, None), "none": (None, None)}[seeding]


def build_model(seeding="graph+op"):
    """A 4-layer MLP with dropout and random ops whose shapes and operands are computed.

    The batch dimension is unknown, so every `Shape` a random op reads is
    computed from an activation: none of them is a constant.
    """
    graph_seed, op_seed = _seeds(seeding, 0)
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        if graph_seed is not None:
            tf1.set_random_seed(graph_seed)

        def seed(k):
            return None if op_seed is None else op_seed + k

        x = tf1.placeholder(tf.float32, [None, WIDTH], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        h = x
        for i in range(LAYERS):
            w = tf1.Variable(rs.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.4,
                             name=f"w{i}", use_resource=True)
            h = tf.nn.relu(tf.matmul(h, w))
            h = tf.nn.dropout(h, rate=0.3, seed=seed(i))
        batch = tf.shape(h)[:1]
        noise = {
            "normal": tf.random.normal(tf.concat([batch, [3]], 0), seed=seed(10)),
            "truncated": tf.random.truncated_normal(tf.concat([batch, [2]], 0), seed=seed(11)),
            "uniform_int": tf.random.uniform(batch, 0, 1000, tf.int32, seed=seed(12)),
            "gamma": tf.random.gamma(batch, alpha=tf.reduce_mean(tf.abs(h)) + 1.0,
                                     seed=seed(13)),
            "poisson": tf.random.poisson(batch, lam=tf.reduce_mean(tf.abs(h)) + 2.0,
                                         seed=seed(14)),
            "shuffled": tf.random.shuffle(h, seed=seed(15)),
            "categorical": tf.random.categorical(h[:, :5], 3, seed=seed(16)),
        }
        logits = tf.matmul(h, tf1.Variable(rs.standard_normal((WIDTH, 3)).astype(np.float32),
                                           name="w_out", use_resource=True))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        loss += 1e-3 * tf.reduce_mean(noise["normal"] + tf.reduce_mean(noise["shuffled"]))
        train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    ops = {op.type for op in g.get_operations()}
    assert {"RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt",
            "RandomGamma", "RandomPoissonV2", "RandomShuffle", "Multinomial"} <= ops, ops
    return g, x, y, loss, train, init, noise


def _batch(size, step):
    rs = np.random.RandomState(1000 + step)
    return (rs.standard_normal((size, WIDTH)).astype(np.float32),
            rs.randint(0, 3, size).astype(np.int32))


# A call: (who runs it on session A, what it runs, the batch size).
CALLS = [("tfmem", "train", 16), ("tfmem", "eval", 8), ("plain", "train", 16),
         ("plain", "eval", 8), ("tfmem", "eval", 16), ("tfmem", "train", 24)]


def _fetches(model, what):
    _, _, _, loss, train, _, noise = model
    if what == "train":
        return [train, loss, noise["normal"], noise["shuffled"]]
    return [loss, noise]


def _run_sequence(calls, seeding, tfmem_kwargs):
    """Run `calls` on session A (mixed) and session B (plain); return both results and A's plans."""
    model = build_model(seeding)
    g, x, y, _, _, init, _ = model
    mixed, reference = new_session(g), new_session(g)
    tfs = tfmem.TFMemSession(mixed, **tfmem_kwargs)
    try:
        mixed.run(init)
        reference.run(init)
        got, expected, plans = [], [], []
        for step, (who, what, size) in enumerate(calls):
            xv, yv = _batch(size, step)
            feed = {x: xv, y: yv}
            fetches = _fetches(model, what)
            if who == "tfmem":
                plan = tfs.plan(fetches, feed_dict=feed)
                tfmem.validate(plan)
                plans.append(plan)
                got.append(tfs.run(fetches, feed_dict=feed))
            else:
                got.append(mixed.run(fetches, feed_dict=feed))
            expected.append(reference.run(fetches, feed_dict=feed))
        return got, expected, plans
    finally:
        tfs.close()
        reference.close()


def _random_ops(plan):
    return {name for name in plan.view.nodes if plan.view.nodes[name].type in
            tfmem.plan.optypes.RANDOM_STREAM}


def test_issue_scenario_dropout_train_eval_plain():
    """The issue's report: train (16), eval (8) and a plain run alternate; eval matched at once."""
    calls = [("tfmem", "train", 16), ("tfmem", "eval", 8), ("plain", "eval", 8),
             ("tfmem", "train", 16), ("tfmem", "eval", 8)]
    got, expected, plans = _run_sequence(calls, "graph+op", {"partition_size": 25})
    assert all(len(p.partitions) > 1 for p in plans)
    for plan in plans:
        random_ops = _random_ops(plan)
        assert random_ops and random_ops <= plan.view.originals  # every stream is the user's op
    for step, (exp, res) in enumerate(zip(expected, got)):
        assert_same_result(exp, res, rtol=1e-5, atol=1e-6, path=f"call {step}")


sequences = st.lists(st.sampled_from(CALLS), min_size=3, max_size=7)
configs = st.sampled_from([
    {"partition_size": 7, "swap": "all", "options": tfmem.Options(swap_min_bytes=0)},
    {"partition_size": 30, "swap": "auto", "options": tfmem.Options(swap_min_bytes=0), "swap_distance": 1},
    {"partition_size": 100000},
    {"device_memory_budget": "1GiB"},  # plans keyed by feed shape: one per batch size
])


@settings(max_examples=25, deadline=None, derandomize=True, print_blob=True,
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow])
@given(calls=sequences, seeding=st.sampled_from(SEEDINGS[:3]), config=configs)
@pytest.mark.slow
def test_interleaved_requests_draw_plain_tensorflows_numbers(calls, seeding, config):
    got, expected, _ = _run_sequence(calls, seeding, config)
    for step, (exp, res) in enumerate(zip(expected, got)):
        assert_same_result(exp, res, rtol=1e-5, atol=1e-6, path=f"call {step} {calls[step]}")


def test_unseeded_ops_never_repeat_across_plans_and_plain_calls():
    calls = [("tfmem", "eval", 8), ("tfmem", "train", 16), ("plain", "eval", 8),
             ("tfmem", "eval", 16), ("tfmem", "eval", 8), ("plain", "eval", 8)]
    got, _, plans = _run_sequence(calls, "none", {"device_memory_budget": "1GiB"})
    # Two plans, train and eval: budget mode serves eval at batch 16 from the plan it
    # compiled for batch 8 (plans are reused across fed shapes, see First step and graph size).
    assert len({id(p) for p in plans}) == 2
    for plan in plans:  # one kernel, hence one stream, per op: the user's
        assert _random_ops(plan) and _random_ops(plan) <= plan.view.originals
    samples = {}
    for (_, what, _), result in zip(calls, got):
        noise = result[1] if what == "eval" else {"normal": result[2], "shuffled": result[3]}
        for key, value in noise.items():
            samples.setdefault(key, []).append(value.tobytes())
    for key in ("normal", "truncated", "gamma"):  # continuous: a repeat means a restarted stream
        assert len(set(samples[key])) == len(samples[key]), key


def test_random_op_reading_a_computed_tensor_runs_as_the_users_op():
    """The plan keeps the op; the partition's callable connects the copies' values to it."""
    g, x, y, loss, train, _, noise = build_model()
    tfs = tfmem.TFMemSession(new_session(g), partition_size=10)
    try:
        plan = tfs.plan([train, loss, noise], feed_dict={x: np.zeros((4, WIDTH)),
                                                          y: np.zeros(4)})
        random_ops = _random_ops(plan)
        assert len(random_ops) == LAYERS + len(noise)
        assert random_ops <= plan.view.originals
        for name in random_ops:  # none reads only constants: each has a computed input
            assert any(t.split(":")[0] in plan.view.nodes for t in plan.view.nodes[name].inputs)
    finally:
        tfs.close()


def test_validate_rejects_an_original_with_a_control_input():
    """Running the user's op would run its control inputs again: not a valid plan."""
    g, x, y, loss, train, _, _ = build_model()
    tfs = tfmem.TFMemSession(new_session(g), partition_size=10)
    try:
        plan = tfs.plan([train, loss], feed_dict={x: np.zeros((4, WIDTH)), y: np.zeros(4)})
        view = plan.view
        original = sorted(_random_ops(plan))[0]
        # an op of its own partition run before it: no other invariant breaks
        ops = next(p.ops for p in plan.partitions if original in p.ops)
        other = next(name for name in ops[:ops.index(original)] if name not in view.originals)
        nodes = dict(view.nodes)
        nodes[original] = dataclasses.replace(nodes[original], control_inputs=(other,))
        broken = dataclasses.replace(plan, view=dataclasses.replace(
            view, nodes=types.MappingProxyType(nodes)))
        with pytest.raises(tfmem.InvalidPlanError) as err:
            tfmem.validate(broken)
        assert str(err.value).count("\n") == 1, err.value  # this one breach only
        assert f"original '{original}' has control inputs ['{other}']" in str(err.value)
    finally:
        tfs.close()


def _control_dependency_model():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        counter = tf1.Variable(0.0, use_resource=True, name="counter")
        bump = counter.assign_add(1.0)
        shape = tf.shape(x)
        with tf.control_dependencies([bump]):  # the random op itself gets the edge
            r = tf.random.uniform(shape, seed=5, name="r")
        assert [op.name for op in g.get_operation_by_name("r/RandomUniform").control_inputs] == \
            [bump.name]
        out = tf.reduce_sum(r * x)
        init = tf1.global_variables_initializer()
    return g, x, counter, bump, out, init


def test_random_op_under_a_control_dependency_runs_with_it_as_the_users_ops():
    """A control edge cannot be cut like a data edge: the op it comes from runs as the
    user's op too, in the same call, once per step (the counter says so)."""
    g, x, counter, bump, out, init = _control_dependency_model()
    mixed, plain = new_session(g), new_session(g)
    tfs = tfmem.TFMemSession(mixed, partition_size=2)
    try:
        plain.run(init)
        tfs.run(init)
        feed = {x: np.ones((2, 3), np.float32)}
        plan = tfs.plan(out, feed_dict=feed)
        assert {"r/RandomUniform", bump.name} <= plan.view.originals
        for batch in (2, 3, 2):  # plain calls on the same session in between
            feed = {x: np.ones((batch, 3), np.float32)}
            assert_same_result(plain.run(out, feed), tfs.run(out, feed))
            assert_same_result(plain.run(out, feed), mixed.run(out, feed))
        assert_same_result(plain.run(counter), tfs.run(counter))  # bumped once per step
    finally:
        plain.close()
        tfs.close()


def test_validate_rejects_a_control_input_run_in_another_partition():
    """An original's control input may be an original only of its own partition: running
    the user's op elsewhere would run it a second time."""
    g, x, _, bump, out, _ = _control_dependency_model()
    tfs = tfmem.TFMemSession(new_session(g), partition_size=2)
    try:
        plan = tfs.plan(out, feed_dict={x: np.ones((2, 3), np.float32)})
        tfmem.validate(plan)
        home = next(p for p in plan.partitions if "r/RandomUniform" in p.ops)
        assert home.index > 0 and bump.name in home.ops
        # bump (reads only its variable) moved to partition 0: no other invariant breaks
        parts = [dataclasses.replace(p, ops=(bump.name,) + p.ops) if p.index == 0 else
                 dataclasses.replace(p, ops=tuple(o for o in p.ops if o != bump.name))
                 if p is home else p for p in plan.partitions]
        broken = dataclasses.replace(plan, partitions=tuple(parts), partition_size=100)
        with pytest.raises(tfmem.InvalidPlanError) as err:
            tfmem.validate(broken)
        assert str(err.value).count("\n") == 1, err.value  # this one breach only
        assert f"original 'r/RandomUniform' has control inputs ['{bump.name}']" in str(err.value)
    finally:
        tfs.close()


def _control_flow_model():
    """Random ops inside a while loop, inside both branches of a cond, and after both."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")

        def body(i, acc):
            return i + 1, acc + tf.random.uniform(tf.shape(acc), seed=3)

        _, acc = tf.while_loop(lambda i, acc: i < 2, body, [tf.constant(0), tf.tanh(x)])
        chosen = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.dropout(acc, 0.5, seed=4),
                         lambda: tf.random.shuffle(acc, seed=5))
        after = chosen + tf.random.normal(tf.shape(chosen), seed=6)
        out = tf.reduce_sum(after, name="out")
        other = tf.reduce_sum(acc * 2.0, name="other")
    return g, x, out, other


@pytest.mark.parametrize("partition_size", [3, 100000])
def test_random_ops_in_and_after_control_flow(control_flow, partition_size):
    """v2 loops and conds (and what follows them) keep one stream per op across plans.

    TensorFlow inlines a v2 loop's or cond's body under the caller's name, so
    the caller runs as the user's op.  In v1, random ops in cond branches and
    after the control flow run as the user's op too, and the one inside the
    v1 while loop runs with its whole loop frame as the user's ops.
    """
    g, x, out, other = _control_flow_model()
    mixed, reference = new_session(g), new_session(g)
    tfs = tfmem.TFMemSession(mixed, partition_size=partition_size)
    requests = [[out], [out, other], [other, out]]
    try:
        plan = tfs.plan(requests[0], {x: np.ones((2, 3), np.float32)})
        drawing = {name for name, node in plan.view.nodes.items()
                   if node.type in tfmem.plan.optypes.RANDOM_STREAM | {"While", "If"}}
        assert drawing and drawing <= plan.view.originals, drawing
        for step in range(6):
            sign = 1.0 if step % 3 else -1.0  # both branches of the cond
            feed = {x: sign * np.ones((2 + step % 2, 3), np.float32)}
            fetches = requests[step % len(requests)]
            runner = mixed.run if step == 4 else tfs.run
            assert_same_result(reference.run(fetches, feed), runner(fetches, feed),
                               path=f"step {step}")
    finally:
        tfs.close()
        reference.close()
