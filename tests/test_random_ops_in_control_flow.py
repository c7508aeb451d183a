"""Random ops with control inputs of their own, and random ops in v1 control flow.

Every case alternates requests that need different plans (other fetches,
other feed shapes) with plain `Session.run` calls on the same session, at
partition sizes 1, 3 and 200, swap on and off, over several steps, beside a
fresh plain session with the same seeds running the same sequence: every
call must match bit for bit, and state a step changes (a counter bumped by
the random op's control input, trained weights) must too.
"""

import contextlib
import dataclasses

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tfmem
from tfmem.plan import optypes
from tfmem.plan.streams import StreamLedger
from conftest import new_session

tf1 = tf.compat.v1

CONFIGS = [  # partition size, swap
    (1, "all"), (2, "none"), (3, "all"), (100000, "none")]
SEEDINGS = {"graph+op": (7, 5), "op": (None, 5), "graph": (7, None)}


def _tfmem(session, partition_size, swap):
    return tfmem.TFMemSession(session, partition_size=partition_size, swap=swap, swap_distance=0,
                              options=tfmem.Options(swap_min_bytes=0))


def _same(expected, got, what):
    """Bit for bit: the same dtypes, shapes and bytes."""
    for i, (e, g) in enumerate(zip(expected, got)):
        e, g = np.asarray(e), np.asarray(g)
        assert e.dtype == g.dtype and e.shape == g.shape, f"{what}[{i}]"
        assert e.tobytes() == g.tobytes(), f"{what}[{i}]: {e} != {g}"


@contextlib.contextmanager
def _v1_graphs():
    """Build graphs with control flow v1; the global toggle is restored afterwards."""
    was_v2 = tf1.control_flow_v2_enabled()
    tf1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()


@pytest.fixture
def v1_control_flow():
    with _v1_graphs():
        yield


INTERLEAVING_CONFIGS = [  # partition size, swap
    (1, "all"), (1, "none"), (3, "all"), (3, "none"), (200, "all"), (200, "none")]

# Who runs each call on the mixed session and which request: three plans of
# tfmem (different fetches, hence different plans) between plain calls.
SEQUENCE = [("tfmem", 0), ("tfmem", 1), ("plain", 0), ("tfmem", 2), ("tfmem", 0),
            ("plain", 1), ("tfmem", 1), ("tfmem", 3), ("tfmem", 2)]


def _interleave(g, init, feed_of, requests, partition_size, swap, state=(),
                sequence=SEQUENCE, min_plans=2):
    """Run `sequence` on a mixed session (tfmem and plain calls) and on a fresh plain one
    with the same seeds; every call, and the `state` after, must match bit for bit.
    `swap` None: `partition_size` is TFMemSession's keyword arguments.
    Returns the plan of the first request."""
    mixed, reference = new_session(g), new_session(g)
    tfs = _tfmem(mixed, partition_size, swap) if swap is not None else \
        tfmem.TFMemSession(mixed, **partition_size)
    names = list(requests)
    try:
        if init is not None:
            mixed.run(init)
            reference.run(init)
        plans = set()
        for step, (who, which) in enumerate(sequence):
            fetches, feed = requests[names[which % len(names)]], feed_of(step)
            if who == "tfmem":
                plan = tfs.plan(fetches, feed)
                tfmem.validate(plan)
                plans.add(id(plan))
            runner = tfs.run if who == "tfmem" else mixed.run
            _same(reference.run(fetches, feed), runner(fetches, feed),
                  f"step {step} {who} {names[which % len(names)]}")
        assert len(plans) >= min_plans  # several plans drew from the same ops
        if state:
            _same(reference.run(list(state)), mixed.run(list(state)), "state after")
        return tfs.plan(requests[names[0]], feed_of(0))
    finally:
        tfs.close()
        reference.close()


def _random_ops(graph):
    return {op.name for op in graph.get_operations() if op.type in optypes.RANDOM_STREAM}


# ---------------------------------------------------------------- own control input

def _control_input_model(seeding):
    graph_seed, op_seed = SEEDINGS[seeding] if seeding else (None, None)
    g = tf.Graph()
    with g.as_default():
        if graph_seed is not None:
            tf1.set_random_seed(graph_seed)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        counter = tf1.Variable(0.0, use_resource=True, name="counter")
        h = tf.tanh(x * 1.5)
        bump = counter.assign_add(tf.reduce_sum(h), name="bump", read_value=False)
        shape = tf.shape(h)
        with tf.control_dependencies([bump]):  # the random op itself gets the edge
            r = tf.random.uniform(shape, seed=op_seed, name="r")
        out = tf.reduce_sum(tf.nn.relu(h - r) * 3.0, name="out")
        other = tf.reduce_max(r, name="other")
        with tf.control_dependencies([bump]):
            count = tf.identity(counter.read_value(), name="count")
        init = tf1.global_variables_initializer()
    assert [c.name for c in g.get_operation_by_name("r/RandomUniform").control_inputs] == ["bump"]
    return g, x, counter, out, other, count, init


def _feed(x, step, batch=3):
    rs = np.random.RandomState(step)
    return {x: rs.standard_normal((batch + step % 2, x.shape[1])).astype(np.float32)}


@pytest.mark.parametrize("seeding", list(SEEDINGS))
@pytest.mark.parametrize("partition_size,swap", INTERLEAVING_CONFIGS)
def test_random_op_with_its_own_control_input(seeding, partition_size, swap):
    """The random op runs as the user's op with its control input (`bump`) in one call:
    requests of different plans and plain calls interleave and draw plain TensorFlow's
    numbers, and `bump` runs once per step (the counter says so)."""
    g, x, counter, out, other, count, init = _control_input_model(seeding)
    requests = {"out+count": [out, count], "out+other": [out, other], "other": [other],
                "count": [count]}
    plan = _interleave(g, init, lambda step: _feed(x, step), requests, partition_size, swap,
                       state=[counter])
    assert {"r/RandomUniform", "bump"} <= plan.view.originals
    home = {op: p.index for p in plan.partitions for op in p.ops}
    assert home["r/RandomUniform"] == home["bump"]
    assert len(plan.partitions) > 1 or partition_size == 200


@pytest.mark.parametrize("partition_size,swap", [(1, "all"), (3, "none"), (200, "all")])
def test_random_op_under_a_chain_of_reference_variable_updates(partition_size, swap):
    """v1 (reference) variables: the random op's control input updates the reference the
    update before it returned.  A reference edge cannot be connected (a connection is a
    value): the op that makes the reference runs as the user's op too."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(4)
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        step = tf1.Variable(0.0, use_resource=False, name="step")
        scale = tf.reduce_mean(tf.abs(x))
        first = tf1.assign_add(step, scale, name="first")  # a float_ref output
        second = tf1.assign_add(first, 1.0, name="second")
        shape = tf.shape(x)
        with tf.control_dependencies([second]):  # the random op itself gets the edge
            r = tf.random.uniform(shape, seed=9, name="r")
        out = tf.reduce_sum(x * r, name="out")
        top = tf.reduce_max(r, name="top")
        with tf.control_dependencies([second]):
            seen = tf.identity(step.read_value(), name="seen")
        init = tf1.global_variables_initializer()
    assert g.get_operation_by_name("second").inputs[0].dtype == tf.float32._as_ref
    assert [c.name for c in r.op.control_inputs] == ["second"]
    requests = {"out+seen": [out, seen], "top": [top], "out": [out], "top+out": [top, out]}

    def feed_of(i):
        return {x: np.arange((2 + i % 2) * 2, dtype=np.float32).reshape(-1, 2) - i}

    plan = _interleave(g, init, feed_of, requests, partition_size, swap, state=[step])
    assert {"r/RandomUniform", "first", "second"} <= plan.view.originals


@pytest.mark.parametrize("partition_size,swap", [(1, "all"), (200, "none")])
def test_random_op_waiting_for_a_fed_placeholder(partition_size, swap):
    """A control input on a fed placeholder: the partition running the user's op is fed
    it, though none of its ops reads it by a data edge."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(6)
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        gate = tf1.placeholder(tf.float32, [], name="gate")
        shape = tf.shape(tf.tanh(x))
        with tf.control_dependencies([gate]):
            r = tf.random.uniform(shape, seed=2, name="r")
        out = tf.reduce_sum(r * x, name="out")
        top = tf.reduce_max(r * gate, name="top")
    assert [c.name for c in r.op.control_inputs] == ["gate"]
    requests = {"out": [out], "top": [top], "both": [top, out]}

    def feed_of(step):
        return {x: np.ones((2 + step % 2, 2), np.float32) * step, gate: np.float32(step)}

    plan = _interleave(g, None, feed_of, requests, partition_size, swap)
    home = next(p for p in plan.partitions if "r/RandomUniform" in p.ops)
    assert "gate:0" in home.feeds and "r/RandomUniform" in plan.view.originals


def test_unseeded_random_op_with_a_control_input_never_repeats_across_plans():
    """No seed, no reference numbers: one kernel, one stream, no draw repeats."""
    g, x, _, out, other, _, init = _control_input_model(None)
    tfs = _tfmem(new_session(g), 2, "none")
    try:
        tfs.run(init)
        feed = _feed(x, 0)
        draws = [tfs.run(other, feed), tfs.run([out, other], feed)[1], tfs.session.run(other, feed),
                 tfs.run(other, feed), tfs.run([out, other], feed)[1]]
        assert len({d.tobytes() for d in draws}) == len(draws)
    finally:
        tfs.close()


def test_the_stream_guard_refuses_a_second_plan_drawing_from_a_copy():
    """Every random op now runs as the user's op; should a seeded one ever run as a copy,
    the session's StreamLedger refuses a second plan drawing from it, naming the op."""
    g, x, _, out, other, _, _ = _control_input_model("graph+op")
    tfs = _tfmem(new_session(g), 3, "none")
    try:
        real = [tfs.plan(fetches, _feed(x, 0)) for fetches in ([out], [other])]
    finally:
        tfs.close()
    drawn = "r/RandomUniform"

    def as_copy(plan):
        return dataclasses.replace(plan, view=dataclasses.replace(
            plan.view, originals=plan.view.originals - {drawn}))

    ledger = StreamLedger()  # the user's op in both plans: one stream
    ledger.claim(g, real[0], "a")
    ledger.claim(g, real[1], "b")
    for first, second in [(as_copy(real[0]), as_copy(real[1])), (real[0], as_copy(real[1])),
                          (as_copy(real[0]), real[1])]:
        ledger = StreamLedger()
        ledger.claim(g, first, "a")
        with pytest.raises(tfmem.UnsupportedGraphError, match=f"'{drawn}' .*second stream"):
            ledger.claim(g, second, "b")


# ---------------------------------------------------------------- v1 control flow

def _v1_model(loop_draws):
    """Random ops in both branches of a v1 cond and after it; optionally one in a v1 loop."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(11)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")

        def body(i, acc):
            step = tf.random.uniform(tf.shape(acc), seed=3) if loop_draws else acc * 0.5
            return i + 1, acc + step

        _, acc = tf1.while_loop(lambda i, acc: i < 2, body, [tf.constant(0), tf.tanh(x)])
        chosen = tf1.cond(  # a branch's constant shape is computed (a pivot's control edge)
            tf.reduce_sum(x) > 0,
            lambda: tf.nn.dropout(acc, rate=0.5, seed=4) + tf.random.uniform([3], seed=8),
            lambda: tf.random.shuffle(acc, seed=5))
        after = chosen + tf.random.normal(tf.shape(chosen), seed=6)
        out = tf.reduce_sum(after, name="out")
        other = tf.reduce_sum(acc * 2.0, name="other")
    assert {"Switch", "Merge", "Enter", "Exit", "NextIteration"} <= {o.type for o in g.get_operations()}
    return g, x, out, other


def _imported(g):
    """The same graph through a GraphDef: no Python control-flow contexts."""
    copy = tf.Graph()
    with copy.as_default():
        tf1.import_graph_def(g.as_graph_def(), name="")
    return copy, *(copy.get_tensor_by_name(n) for n in ("x:0", "out:0", "other:0"))


def _signed_feed(x, step):
    sign = 1.0 if step % 3 else -1.0  # both branches of the cond
    return {x: sign * (1.0 + np.arange((2 + step % 2) * 3, dtype=np.float32).reshape(-1, 3))}


@pytest.mark.parametrize("source", ["python", "graph_def"])
@pytest.mark.parametrize("partition_size,swap", CONFIGS)
def test_random_ops_in_a_v1_cond_and_after_v1_control_flow(v1_control_flow, source,
                                                            partition_size, swap):
    """They run as the user's ops: any interleaving of requests and plain calls matches."""
    g, x, out, other = _v1_model(loop_draws=False)
    if source == "graph_def":
        g, x, out, other = _imported(g)
    mixed, reference = new_session(g), new_session(g)
    tfs = _tfmem(mixed, partition_size, swap)
    try:
        plan = tfs.plan([out], _signed_feed(x, 0))
        assert _random_ops(g) <= plan.view.originals
        requests = [[out], [out, other], [other, out]]
        for step in range(7):
            feed, fetches = _signed_feed(x, step), requests[step % 3]
            runner = mixed.run if step == 4 else tfs.run
            _same(reference.run(fetches, feed), runner(fetches, feed), f"step {step}")
    finally:
        tfs.close()
        reference.close()


@pytest.mark.parametrize("source", ["python", "graph_def"])
@pytest.mark.parametrize("partition_size,swap", INTERLEAVING_CONFIGS)
def test_random_op_in_a_v1_while_loop(v1_control_flow, source, partition_size, swap):
    """The whole loop frame runs as the user's ops, its Enters' inputs connected: requests
    of different plans and plain calls interleave and draw plain TensorFlow's numbers."""
    g, x, out, other = _v1_model(loop_draws=True)
    if source == "graph_def":
        g, x, out, other = _imported(g)
    requests = {"both": [out, other], "other": [other], "out": [out], "other+out": [other, out]}
    plan = _interleave(g, None, lambda step: _signed_feed(x, step), requests, partition_size,
                       swap)
    frame = {op.name for op in g.get_operations() if op.name.startswith("while/")}
    assert _random_ops(g) <= plan.view.originals
    assert frame & set(plan.view.nodes) <= plan.view.originals
    assert len({p.index for p in plan.partitions if frame & set(p.ops)}) == 1  # one call
    assert len(plan.partitions) > 1 or partition_size == 200


def _v1_loop_training_model():
    """Dropout and noise inside a v1 while loop, trained through it: the gradient loop
    pops the forward loop's per-step stacks, so both loops run in one call."""
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(21)
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        w = tf1.Variable(rs.standard_normal((4, 4)).astype(np.float32) * 0.5, name="w",
                         use_resource=True)

        def body(i, acc):
            h = tf.tanh(tf.matmul(acc, w))
            h = tf.nn.dropout(h, rate=0.3, seed=2)
            return i + 1, h + tf.random.normal(tf.shape(h), stddev=0.01, seed=3)

        _, acc = tf1.while_loop(lambda i, a: i < 3, body, [tf.constant(0), x * 2.0])
        loss = tf.reduce_mean(tf.square(acc - 0.5), name="loss")
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        spread = tf.reduce_max(acc, name="spread")
        init = tf1.global_variables_initializer()
    assert {"StackV2", "StackPushV2", "StackPopV2"} <= {o.type for o in g.get_operations()}
    return g, x, w, loss, train, spread, init


@pytest.mark.parametrize("partition_size,swap", INTERLEAVING_CONFIGS)
def test_random_ops_in_a_trained_v1_while_loop(v1_control_flow, partition_size, swap):
    g, x, w, loss, train, spread, init = _v1_loop_training_model()
    requests = {"train": [train, loss], "loss": [loss], "spread": [spread, loss],
                "train+spread": [train, spread]}

    def feed_of(step):
        rs = np.random.RandomState(step)
        return {x: rs.standard_normal((2 + step % 3, 4)).astype(np.float32)}

    plan = _interleave(g, init, feed_of, requests, partition_size, swap, state=[w])
    assert _random_ops(g) <= plan.view.originals


def _v1_recurrent_model():
    """A recurrent net as tf.compat.v1 builds one: a v1 while loop over TensorArrays with
    dropout in its body; a noise draw waits (control edge) for a stateless identity of the
    loss, and training goes through both."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(5)
        x = tf1.placeholder(tf.float32, [None, 5, 3], name="x")
        w = tf1.Variable(np.eye(3, dtype=np.float32) * 0.7, name="w", use_resource=True)
        steps = tf.transpose(x, [1, 0, 2])
        inputs = tf1.TensorArray(tf.float32, size=5).unstack(steps)

        def body(t, h, outputs):
            h = tf.tanh(tf.matmul(inputs.read(t), w) + tf.matmul(h, w))
            h = tf.nn.dropout(h, rate=0.25, seed=7)
            return t + 1, h, outputs.write(t, h)

        _, h, outputs = tf1.while_loop(lambda t, h, o: t < 5, body,
                                       [0, tf.zeros_like(steps[0]),
                                        tf1.TensorArray(tf.float32, size=5)])
        sequence = outputs.stack()
        loss = tf.reduce_mean(tf.square(sequence)) + tf.reduce_mean(h)
        shape = tf.shape(h)
        with tf.control_dependencies([tf.identity(loss)]):
            noise = tf.random.normal(shape, seed=3, name="noise")
        train = tf1.train.AdamOptimizer(0.05).minimize(loss + tf.reduce_mean(noise))
        init = tf1.global_variables_initializer()
    return g, x, w, loss, noise, sequence, train, init


@pytest.mark.parametrize("partition_size,swap", [(1, "all"), (3, "none"), (200, "all")])
def test_dropout_in_a_v1_recurrent_loop_over_tensor_arrays(v1_control_flow, partition_size,
                                                           swap):
    g, x, w, loss, noise, sequence, train, init = _v1_recurrent_model()
    requests = {"train+noise": [train, noise], "train": [train, loss], "noise": [loss, noise],
                "sequence": [sequence]}

    def feed_of(step):
        rs = np.random.RandomState(step)
        return {x: rs.standard_normal((2 + step % 2, 5, 3)).astype(np.float32)}

    plan = _interleave(g, init, feed_of, requests, partition_size, swap, state=[w])
    assert _random_ops(g) <= plan.view.originals
    assert "noise/RandomStandardNormal" in plan.view.originals


@pytest.mark.parametrize("model", ["loop", "trained loop"])
def test_unseeded_random_ops_in_a_v1_while_loop_never_repeat_across_plans(v1_control_flow,
                                                                           model):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.Variable(np.eye(3, dtype=np.float32), name="w", use_resource=True)
        _, acc = tf1.while_loop(
            lambda i, a: i < 2,
            lambda i, a: (i + 1, tf.matmul(a, w) + tf.random.uniform(tf.shape(a))), [0, x])
        drawn = tf.identity(acc, name="drawn")
        total = tf.reduce_sum(acc, name="total")
        extra = [tf1.train.GradientDescentOptimizer(0.1).minimize(total)] \
            if model == "trained loop" else []
        init = tf1.global_variables_initializer()
    tfs = _tfmem(new_session(g), 2, "all")
    try:
        tfs.run(init)
        feed = {x: np.zeros((2, 3), np.float32)}
        draws = [tfs.run(drawn, feed), tfs.run([total, drawn] + extra, feed)[1],
                 tfs.session.run(drawn, feed), tfs.run(drawn, feed),
                 tfs.run([total, drawn] + extra, feed)[1]]
        assert len({d.tobytes() for d in draws}) == len(draws)
    finally:
        tfs.close()


# ---------------------------------------------------------------- dropout in training

def _dropout_mlp():
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(3)
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        h = x
        for i, width in enumerate((8, 8, 2)):
            w = tf1.Variable(rs.standard_normal((h.shape[1], width)).astype(np.float32) * 0.5,
                             name=f"w{i}", use_resource=True)
            h = tf.matmul(h, w)
            if i < 2:
                h = tf.nn.dropout(tf.nn.relu(h), rate=0.4, seed=i + 1)
        loss = tf.reduce_mean(tf.square(h - y), name="loss")
        train = tf1.train.AdamOptimizer(0.01).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, x, y, loss, train, init


def test_dropout_in_a_training_step_at_sizes_that_cut_next_to_it():
    """Every partition size from 1 to 12 puts a boundary just before or after a dropout draw
    somewhere; training, evaluation and plain calls interleave and match plain TensorFlow."""
    g, x, y, loss, train, init = _dropout_mlp()
    draws = _random_ops(g)
    cuts = set()
    for partition_size in range(1, 13):
        swap = "all" if partition_size % 2 else "none"
        mixed, reference = new_session(g), new_session(g)
        tfs = _tfmem(mixed, partition_size, swap)
        try:
            mixed.run(init)
            reference.run(init)
            for step in range(4):
                rs = np.random.RandomState(step)
                feed = {x: rs.standard_normal((5, 6)).astype(np.float32),
                        y: rs.standard_normal((5, 2)).astype(np.float32)}
                fetches = [train, loss] if step != 2 else [loss]
                if step == 0:
                    plan = tfs.plan(fetches, feed)
                    assert draws <= plan.view.originals
                    for p in plan.partitions:
                        cuts |= {("first" if p.ops[0] == d else "last")
                                 for d in draws if d in (p.ops[0], p.ops[-1])}
                runner = mixed.run if step == 3 else tfs.run
                _same(reference.run(fetches, feed), runner(fetches, feed),
                      f"partition_size {partition_size} step {step}")
        finally:
            tfs.close()
            reference.close()
    assert cuts == {"first", "last"}, cuts


def test_budget_mode_serves_new_batch_sizes_with_one_stream():
    """Budget mode keys plans by fed shapes and serves a new shape from an earlier plan's
    copies; the random op with a control input of its own keeps its one stream, and its
    control input runs once per step, as in plain TensorFlow."""
    g, x, _, out, _, count, init = _control_input_model("graph+op")
    plain = new_session(g)
    tfs = tfmem.TFMemSession(new_session(g), device_memory_budget="1GiB")
    try:
        plain.run(init)
        tfs.run(init)
        for step in range(4):
            feed = _feed(x, step, batch=3 + 4 * step)
            _same(plain.run([out, count], feed), tfs.run([out, count], feed), f"step {step}")
            assert step == 0 or tfs.last_compile.reused
    finally:
        plain.close()
        tfs.close()


@pytest.mark.parametrize("source", ["python", "graph_def"])
@pytest.mark.parametrize("partition_size,swap", [(1, "none"), (3, "all"), (200, "none")])
def test_random_op_after_an_inner_v1_loop_is_still_inside_the_outer_one(v1_control_flow, source,
                                                                        partition_size, swap):
    """Frames are found through nested loops: an inner loop's Exit does not leave the outer
    loop, so the random op there brings the whole outer frame (inner loop included)."""
    g = tf.Graph()
    with g.as_default():
        tf1.set_random_seed(1)
        x = tf1.placeholder(tf.float32, [None, 3], name="x")

        def outer(i, acc):
            _, inner = tf1.while_loop(lambda j, a: j < 2, lambda j, a: (j + 1, a * 0.9), [0, acc])
            return i + 1, inner + tf.random.uniform(tf.shape(inner), seed=2, name="mid")

        _, acc = tf1.while_loop(lambda i, a: i < 2, outer, [0, x])
        tf.reduce_sum(acc + tf.random.normal(tf.shape(acc), seed=3, name="after"), name="out")
        tf.reduce_max(acc, name="top")
    if source == "graph_def":
        copy = tf.Graph()
        with copy.as_default():
            tf1.import_graph_def(g.as_graph_def(), name="")
        g = copy
    x, out, top = (g.get_tensor_by_name(n) for n in ("x:0", "out:0", "top:0"))
    requests = {"out": [out], "top": [top], "both": [top, out]}
    plan = _interleave(g, None, lambda step: {x: np.full((2 + step % 2, 3), step + 1.0,
                                                         np.float32)},
                       requests, partition_size, swap)
    assert {"after/RandomStandardNormal", "while/mid/RandomUniform"} <= plan.view.originals
    inner = {n for n in plan.view.nodes if n.startswith("while/while/")}
    assert inner and inner <= plan.view.originals


# ---------------------------------------------------------------- any interleaving

def _case(name):
    """(graph, init, feed for a step, requests, state) of one of this file's cases."""
    if name == "control input":
        g, x, counter, out, other, count, init = _control_input_model("graph+op")
        return g, init, lambda step: _feed(x, step), \
            {"a": [out, count], "b": [other], "c": [out, other], "d": [count]}, [counter]
    if name == "v1 loop":
        g, x, out, other = _v1_model(loop_draws=True)
        return g, None, lambda step: _signed_feed(x, step), \
            {"a": [out, other], "b": [other], "c": [out], "d": [other, out]}, []
    g, x, w, loss, train, spread, init = _v1_loop_training_model()
    return g, init, lambda step: {x: np.full((2 + step % 3, 4), 0.1 * step, np.float32)}, \
        {"a": [train, loss], "b": [loss], "c": [spread], "d": [train, spread]}, [w]


@settings(max_examples=24, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(["control input", "v1 loop", "trained v1 loop"]),
       sequence=st.lists(st.tuples(st.sampled_from(["tfmem", "plain"]), st.integers(0, 3)),
                         min_size=3, max_size=8),
       config=st.sampled_from([{"partition_size": 1, "swap": "all",
                                "options": tfmem.Options(swap_min_bytes=0)},
                               {"partition_size": 3, "swap": "none"},
                               {"partition_size": 200, "swap": "all",
                                "options": tfmem.Options(swap_min_bytes=0)},
                               {"device_memory_budget": "1GiB"}]))
def test_any_interleaving_draws_plain_tensorflows_numbers(case, sequence, config):
    """Random sequences of requests (any of four fetch sets, feed shapes changing with the
    step) and plain calls, in every session mode, budget mode's per-shape plans included."""
    with _v1_graphs():
        g, init, feed_of, requests, state = _case(case)
    _interleave(g, init, feed_of, requests, config, None, state=state, sequence=sequence,
                min_plans=0)
