"""Session.run's RunMetadata and default-session contract, through TFMemSession.

Each case runs the same request on a plain session and through
`TFMemSession(partition_size=3)` (several partition calls per step) and
compares what comes back: step statistics only with a trace (tfmem's own
measured steps never leak into them), one device entry per device, partition
graphs one per device, a cost graph where the session builds cost models, and
an InteractiveSession whose default-session stack tfmem leaves alone (cases
after TensorFlow's session_test.py).  tfmem measures steps only where
TensorFlow keeps allocator figures, so the leak check runs in subprocesses
whose allocators keep them, one per kernel path.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import assert_same_result, run_worker

tf1 = tf.compat.v1

PARTITION_SIZE = 3


def _graph():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 3], name="x")
        w = tf1.Variable(np.full((3, 3), 0.5, np.float32), name="w")
        h = x
        for i in range(6):
            h = tf.tanh(tf.matmul(h, w) * 0.5, name=f"h{i}")
        loss = tf.reduce_sum(h, name="loss")
        init = tf1.global_variables_initializer()
    return g, x, loss, init


FEED = np.arange(12, dtype=np.float32).reshape(4, 3) / 10.0


def _pair(config, closed_at_teardown):
    """(plain session, TFMemSession) of one graph each, initialized; fetches and feed."""
    sessions = []
    for wrap in (False, True):
        g, x, loss, init = _graph()
        sess, = closed_at_teardown(tf1.Session(graph=g, config=config))
        sess.run(init)
        sessions.append((tfmem.TFMemSession(sess, partition_size=PARTITION_SIZE) if wrap
                         else sess, loss, {x: FEED}))
    return sessions


def _config(**graph_options):
    """Grappler off (tfmem.session_config): both sessions run the graph's own ops."""
    return tfmem.session_config(tf1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=2,
        graph_options=tf1.GraphOptions(**graph_options)))


def _run(sess, loss, feed, options=None):
    metadata = tf1.RunMetadata()
    value = sess.run(loss, feed, options=options, run_metadata=metadata)
    return value, metadata


def _fields(metadata):
    return sorted(f.name for f, _ in metadata.ListFields())


def _devices(metadata):
    return [d.device for d in metadata.step_stats.dev_stats]


def test_trace_and_partition_graphs_one_entry_per_device(closed_at_teardown):
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE, output_partition_graphs=True)
    (plain, loss_p, feed_p), (tfs, loss_t, feed_t) = _pair(_config(), closed_at_teardown)
    expected, want = _run(plain, loss_p, feed_p, options)
    got, metadata = _run(tfs, loss_t, feed_t, options)
    assert_same_result(expected, got)
    assert tfs.last_step.calls > 1  # several session calls made this one step
    assert _fields(metadata) == _fields(want)
    assert _devices(metadata) == _devices(want)
    assert ([g.node[0].device for g in metadata.partition_graphs]
            == [g.node[0].device for g in want.partition_graphs])
    graph, = metadata.partition_graphs
    names = [n.name for n in graph.node]
    assert len(names) == len(set(names))
    # the graph is whole: every input names a node of it
    assert all(i.lstrip("^").split(":")[0] in names for n in graph.node for i in n.input)
    # every op of the user's that plain TensorFlow ran ran in some call (as a copy)
    ran = {tfmem_name.rsplit("/", 1)[-1] for tfmem_name in names}
    assert {f"h{i}" for i in range(6)} <= ran
    stats = metadata.step_stats.dev_stats[0].node_stats
    ran_stats = {n.node_name.rsplit("/", 1)[-1] for n in stats}
    assert {f"h{i}" for i in range(6)} <= ran_stats
    # without the options: nothing but what plain TensorFlow returns
    _, want = _run(plain, loss_p, feed_p)
    _, metadata = _run(tfs, loss_t, feed_t)
    assert _fields(metadata) == _fields(want) == []


def test_cost_graph_when_the_session_builds_cost_models(closed_at_teardown):
    (plain, loss_p, feed_p), (tfs, loss_t, feed_t) = _pair(_config(build_cost_model=1),
                                                          closed_at_teardown)
    for options in (None, tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)):
        expected, want = _run(plain, loss_p, feed_p, options)
        got, metadata = _run(tfs, loss_t, feed_t, options)
        assert_same_result(expected, got)
        assert want.cost_graph.node, "plain TensorFlow built no cost graph"
        assert _fields(metadata) == _fields(want)
        assert _devices(metadata) == _devices(want)
        nodes = metadata.cost_graph.node
        ids = [n.id for n in nodes]
        assert len(ids) == len(set(ids))
        assert all(e.preceding_node in ids for n in nodes for e in n.input_info)
        assert all(c in ids for n in nodes for c in n.control_input)
        keys = [(n.name, n.device) for n in nodes]
        assert len(keys) == len(set(keys))
        # named after the user's ops: every op of the user's plain TensorFlow costed
        names = {n.name for n in nodes}
        users = {n.name for n in want.cost_graph.node if not n.name.startswith("_")}
        assert users <= names, users - names


def test_cost_graph_every_nth_step(closed_at_teardown):
    """build_cost_model=2: a cost graph on every second step of the request, as plain."""
    (plain, loss_p, feed_p), (tfs, loss_t, feed_t) = _pair(_config(build_cost_model=2),
                                                          closed_at_teardown)
    want = [bool(_run(plain, loss_p, feed_p)[1].cost_graph.node) for _ in range(4)]
    got = [bool(_run(tfs, loss_t, feed_t)[1].cost_graph.node) for _ in range(4)]
    assert got == want and any(want) and not all(want)


_LEAK = r'''
import json
import numpy as np
import tensorflow as tf
import tfmem
tf1 = tf.compat.v1
out = {}


def session(name, config, **options):
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [64, 64])
        h = x
        for i in range(6):
            h = tf.tanh(tf.matmul(h, h) * 0.01)
    sess = tf1.Session(graph=g, config=config)
    run = sess if name == "plain" else tfmem.TFMemSession(sess, partition_size=3, **options)
    return run, h, {x: np.full((64, 64), 0.5, np.float32)}


threads = dict(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
for name in ("plain", "tfmem"):
    run, h, feed = session(name, tf1.ConfigProto(**threads),
                          options=tfmem.Options(measure="every"))
    steps = []
    for options in (None, tf1.RunOptions(trace_level=tf1.RunOptions.SOFTWARE_TRACE), None):
        md = tf1.RunMetadata()
        run.run(h, feed, options=options, run_metadata=md)
        steps.append([len(md.step_stats.dev_stats), sorted(f.name for f, _ in md.ListFields())])
    # every second step builds a cost model; tfmem measures its first steps only
    run_cost, h, feed = session(name, tf1.ConfigProto(
        graph_options=tf1.GraphOptions(build_cost_model=2), **threads))
    costed = []
    for _ in range(7):
        md = tf1.RunMetadata()
        run_cost.run(h, feed, run_metadata=md)
        costed.append(len(md.cost_graph.node) > 0)
    out[name] = {"steps": steps, "costed": costed,
                 "measured": name == "tfmem" and bool(run.last_step.measured)}
print("TFMEM-RESULTS " + json.dumps(out))
'''


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_measured_steps_leave_the_users_run_metadata_alone(onednn):
    """tfmem traces the steps it measures; the user's RunMetadata gets step statistics only
    when the user asked for a trace (allocators that keep figures: tfmem measures)."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2",
               TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB="4096")
    out = run_worker(_LEAK, env, timeout=180)
    assert out["tfmem"]["measured"], "tfmem measured nothing: the check proves nothing"
    assert out["plain"]["steps"][0] == [0, []]
    assert out["tfmem"]["steps"] == out["plain"]["steps"]
    assert any(out["plain"]["costed"]) and not all(out["plain"]["costed"])
    assert out["tfmem"]["costed"] == out["plain"]["costed"]


# --------------------------------------------------------------------------
# InteractiveSession (TensorFlow's testInteractive, testInteractivePlacePrunedGraph)


@pytest.fixture
def graph_mode():
    """A fresh default graph, as TensorFlow's v1 session tests run in."""
    with tf.Graph().as_default() as g:
        yield g


def test_interactive_session_wrapped_then_closed(graph_mode):  # pylint: disable=unused-argument
    results = []
    for wrap in (False, True):
        sess = tf1.InteractiveSession()
        run = tfmem.TFMemSession(sess, partition_size=PARTITION_SIZE) if wrap else sess
        with tf.device("/cpu:0"):
            a = tf.constant(1.0, shape=[1, 2])
            b = tf.constant(2.0, shape=[2, 3])
            c = tf.matmul(a, b)
            h = c
            for _ in range(5):
                h = tf.tanh(h * 0.5)
        got = [run.run(h), c.eval()]
        d = tf.constant([1.0, 2.0, 3.0], shape=[3, 1])
        e = tf.matmul(c, d)
        got += [e.eval(), run.run(e)]
        assert tf1.get_default_session() is sess
        sess.close()  # the InteractiveSession leaves the stack it entered
        assert tf1.get_default_session() is None
        results.append(got)
    assert_same_result(results[0], results[1])


def test_interactive_session_places_the_pruned_graph(graph_mode):  # pylint: disable=unused-argument
    for wrap in (False, True):
        sess = tf1.InteractiveSession()
        run = tfmem.TFMemSession(sess, partition_size=PARTITION_SIZE) if wrap else sess
        with tf.device("/device:GPU:0"):
            a = tf.constant(1.0, shape=[1, 2])  # no GPU here: cannot be placed
        b = tf.constant(1.0, shape=[1, 2])
        np.testing.assert_array_equal(b.eval(), np.ones((1, 2)))
        np.testing.assert_array_equal(run.run(b), np.ones((1, 2)))
        with pytest.raises(tf.errors.InvalidArgumentError):
            a.eval()
        with pytest.raises(tf.errors.InvalidArgumentError):
            run.run(a)
        sess.close()
        assert tf1.get_default_session() is None


def test_interactive_session_wrapper_closes_it(graph_mode):  # pylint: disable=unused-argument
    sess = tf1.InteractiveSession()
    tfs = tfmem.TFMemSession(sess, partition_size=PARTITION_SIZE)
    x = tf.constant(2.0)
    y = x
    for _ in range(5):
        y = y * 1.5
    with tfs.as_default():  # eval through tfmem, as for any session
        assert tf1.get_default_session() is tfs
        assert y.eval() == pytest.approx(2.0 * 1.5 ** 5)
        assert tfs.last_step.partitions > 1
    assert tf1.get_default_session() is sess
    tfs.close()
    assert tf1.get_default_session() is None
