"""TFMemSession is accepted wherever TensorFlow's helpers accept a session.

Each helper is used on a plain session and on a TFMemSession (around a second
session of the same graph, and `tfmem.Session`, whose session graph is its own),
and both must give the same results: queue
runners with a coordinator, Saver.save/restore, FileWriter with summary ops,
partial_run, make_callable, as_default (Tensor.eval / Operation.run),
list_devices, InteractiveSession-style use.
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import assert_same_result, new_session, session_config

tf1 = tf.compat.v1

PARTITION_SIZE = 4


def _model():
    rs = np.random.RandomState(1)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        w = tf1.Variable(rs.standard_normal((3, 2)).astype(np.float32), name="w")
        h = tf.matmul(x, w)
        for i in range(6):
            h = tf.tanh(h * 1.1 + 0.1, name=f"h{i}")
        loss = tf.reduce_mean(tf.square(h), name="loss")
        train = tf1.train.GradientDescentOptimizer(0.2).minimize(loss)
        summary = tf1.summary.merge([tf1.summary.scalar("loss", loss),
                                     tf1.summary.histogram("w", w)])
        init = tf1.global_variables_initializer()
    feed = {x: rs.standard_normal((5, 3)).astype(np.float32)}
    return g, dict(x=x, w=w, h=h, loss=loss, train=train, summary=summary, init=init, feed=feed)


@pytest.fixture
def model(both_pairs):
    g, m = _model()
    m["plain"], m["tfs"] = both_pairs(g, PARTITION_SIZE, m["init"])
    return m


def test_is_a_session_interface(model):
    from tensorflow.python.client import session as tf_session  # pylint: disable=import-outside-toplevel
    assert isinstance(model["tfs"], tf_session.SessionInterface)
    assert model["tfs"].sess_str == model["plain"].sess_str
    assert ([d.name for d in model["tfs"].list_devices()]
            == [d.name for d in model["plain"].list_devices()])


@pytest.mark.parametrize("own_session", [False, True], ids=["wrapped", "own"])
def test_queue_runners_and_coordinator(own_session):
    """A queue-runner input pipeline read until its one epoch runs out."""
    def program(make):
        rs = np.random.RandomState(2)
        features = rs.standard_normal((24, 3)).astype(np.float32)
        labels = (features.sum(axis=1) > 0).astype(np.float32)
        g = tf.Graph()
        with g.as_default():
            feature, label = tf1.train.slice_input_producer(
                [tf.constant(features), tf.constant(labels)], num_epochs=1, shuffle=False)
            xb, yb = tf1.train.batch([feature * 2.0 - 0.5, label], batch_size=4, num_threads=1)
            w = tf1.Variable(np.full((3, 1), 0.1, np.float32), name="w")
            logits = tf.squeeze(tf.matmul(xb, w), 1)
            for _ in range(4):
                logits = logits * 0.9 + 0.01
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=yb, logits=logits))
            train = tf1.train.GradientDescentOptimizer(0.5).minimize(loss)
            init = [tf1.global_variables_initializer(), tf1.local_variables_initializer()]
        sess = make(g)
        sess.run(init)
        coord = tf1.train.Coordinator()
        with g.as_default():
            threads = tf1.train.start_queue_runners(sess=sess, coord=coord)
        losses = []
        try:
            while not coord.should_stop():
                losses.append(sess.run([train, loss])[1])
        except tf.errors.OutOfRangeError:
            pass
        finally:
            coord.request_stop()
        coord.join(threads)
        # (last_step may be a queue runner's step: ask the plan of the training request)
        partitions = (len(sess.plan([train, loss]).partitions)
                      if isinstance(sess, tfmem.TFMemSession) else None)
        sess.close()
        return losses, partitions

    expected, _ = program(new_session)
    got, partitions = program(
        lambda g: tfmem.Session(graph=g, config=session_config(), partition_size=PARTITION_SIZE)
        if own_session else tfmem.TFMemSession(new_session(g), partition_size=PARTITION_SIZE))
    assert len(expected) == 6
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert partitions > 1


def test_saver_save_and_restore(model, tmp_path):
    with model["w"].graph.as_default():
        _save_and_restore(model, tmp_path)


def _save_and_restore(model, tmp_path):
    saver = tf1.train.Saver()
    plain, tfs = model["plain"], model["tfs"]
    for _ in range(2):
        plain.run(model["train"], model["feed"])
        tfs.run(model["train"], model["feed"])
    saved = saver.save(tfs, str(tmp_path / "tfmem.ckpt"))
    reference = saver.save(plain, str(tmp_path / "plain.ckpt"))
    np.testing.assert_allclose(tf.train.load_variable(saved, "w"),
                               tf.train.load_variable(reference, "w"), rtol=1e-6)
    trained = tfs.run(model["w"])
    tfs.run(model["train"], model["feed"])  # move away, then restore
    saver.restore(tfs, saved)
    np.testing.assert_array_equal(tfs.run(model["w"]), trained)
    np.testing.assert_allclose(tfs.run(model["loss"], model["feed"]),
                               plain.run(model["loss"], model["feed"]), rtol=1e-6)


def test_file_writer_with_summary_ops(model, tmp_path):
    plain, tfs = model["plain"], model["tfs"]
    for name, sess in (("plain", plain), ("tfmem", tfs)):
        with sess.graph.as_default():
            writer = tf1.summary.FileWriter(str(tmp_path / name), sess.graph)
            for step in range(3):
                summary, _ = sess.run([model["summary"], model["train"]], model["feed"])
                writer.add_summary(summary, step)
            writer.close()
    def scalars(directory):
        return [(e.step, v.simple_value) for path in sorted(tmp_path.joinpath(directory).iterdir())
                for e in tf1.train.summary_iterator(str(path)) for v in e.summary.value
                if v.tag.startswith("loss")]
    assert [s for s, _ in scalars("tfmem")] == [0, 1, 2]
    np.testing.assert_allclose([v for _, v in scalars("tfmem")],
                               [v for _, v in scalars("plain")], rtol=1e-5)


def test_partial_run_goes_to_the_wrapped_session(model):
    g = model["w"].graph
    with g.as_default():
        a = tf1.placeholder(tf.float32, [], name="a")
        b = tf1.placeholder(tf.float32, [], name="b")
        c = a * 2.0
        d = c + b
    results = []
    for sess in (model["plain"], model["tfs"]):
        handle = sess.partial_run_setup([c, d], [a, b])
        first = sess.partial_run(handle, c, feed_dict={a: 3.0})
        results.append((first, sess.partial_run(handle, d, feed_dict={b: 0.5})))
    assert results[0] == results[1] == (6.0, 6.5)


@pytest.mark.parametrize("accept_options", [False, True])
def test_make_callable_runs_partitioned(model, accept_options):
    plain, tfs = model["plain"], model["tfs"]
    fetches = [model["loss"], {"h": model["h"]}]
    expected = plain.make_callable(fetches, [model["x"]], accept_options)(model["feed"][model["x"]])
    step = tfs.make_callable(fetches, [model["x"]], accept_options)
    assert_same_result(expected, step(model["feed"][model["x"]]))
    assert tfs.last_step.partitions > 1
    no_feeds = tfs.make_callable(model["w"], accept_options=accept_options)
    assert_same_result(plain.make_callable(model["w"])(), no_feeds())
    if accept_options:
        metadata = tf1.RunMetadata()
        no_feeds(options=tf1.RunOptions(output_partition_graphs=True), run_metadata=metadata)
        assert metadata.partition_graphs
    with pytest.raises(TypeError):
        tfs.make_callable(model["loss"], feed_list=model["x"])
    with pytest.raises(TypeError):
        tfs.make_callable(3)


def test_as_default_runs_eval_through_tfmem(model):
    plain, tfs = model["plain"], model["tfs"]
    with plain.as_default():
        expected = model["loss"].eval(model["feed"])
    with tfs.as_default():
        assert tf1.get_default_session() is tfs
        got = model["loss"].eval(model["feed"])
        assert tfs.last_step.partitions > 1
        model["train"].run(model["feed"])
    plain.run(model["train"], model["feed"])
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(tfs.run(model["w"]), plain.run(model["w"]), rtol=1e-6)


def test_with_block_makes_the_wrapper_default_then_closes():
    g, m = _model()
    plain = new_session(g)
    plain.run(m["init"])
    expected = plain.run(m["loss"], m["feed"])
    plain.close()
    with tfmem.TFMemSession(new_session(g), partition_size=PARTITION_SIZE) as tfs:
        assert tf1.get_default_session() is tfs and tf1.get_default_graph() is g
        m["init"][0].run() if isinstance(m["init"], list) else m["init"].run()
        np.testing.assert_allclose(m["loss"].eval(m["feed"]), expected, rtol=1e-6)
        with pytest.raises(RuntimeError, match="re-entrant"):
            tfs.__enter__()
    assert tf1.get_default_session() is None
    with pytest.raises(RuntimeError):
        tfs.run(m["loss"], m["feed"])


def test_interactive_session_style():
    """The wrapper leaves TensorFlow's default session alone: `eval()` runs on the
    InteractiveSession, and through tfmem inside `tfs.as_default()`."""
    g, m = _model()
    plain = new_session(g)
    plain.run(m["init"])
    expected = plain.run(m["loss"], m["feed"])
    plain.close()
    with g.as_default():
        sess = tf1.InteractiveSession(config=session_config())
        tfs = tfmem.TFMemSession(sess, partition_size=PARTITION_SIZE)
        try:
            assert tf1.get_default_session() is sess
            m["init"].run()
            np.testing.assert_allclose(m["loss"].eval(m["feed"]), expected, rtol=1e-6)
            assert tfs.last_step is None
            with tfs.as_default():
                np.testing.assert_allclose(m["loss"].eval(m["feed"]), expected, rtol=1e-6)
            assert tfs.last_step.partitions > 1
        finally:
            tfs.close()
        assert tf1.get_default_session() is None


def test_run_metadata_is_replaced_by_every_run(model):
    """As Session.run: the step's partition graphs with the option, none without."""
    graphs = tf1.RunOptions(output_partition_graphs=True)
    counts = []
    for sess in (model["plain"], model["tfs"]):
        metadata = tf1.RunMetadata()
        sess.run(model["loss"], model["feed"], options=graphs, run_metadata=metadata)
        with_option = len(metadata.partition_graphs)
        sess.run(model["loss"], model["feed"], options=graphs, run_metadata=metadata)
        assert len(metadata.partition_graphs) == with_option > 0
        sess.run(model["loss"], model["feed"], run_metadata=metadata)
        assert not metadata.partition_graphs
        counts.append(with_option)
    # one partition graph per device, whatever the number of tfmem's calls
    assert counts[0] == counts[1]


def test_failed_run_leaves_run_metadata_alone(model):
    graphs = tf1.RunOptions(output_partition_graphs=True)
    for sess in (model["plain"], model["tfs"]):
        metadata = tf1.RunMetadata()
        sess.run(model["loss"], model["feed"], options=graphs, run_metadata=metadata)
        before = metadata.SerializeToString()
        with pytest.raises(tf.errors.InvalidArgumentError):
            sess.run(model["loss"], options=graphs, run_metadata=metadata)  # x not fed
        assert metadata.SerializeToString() == before


_DISTRIBUTED = r'''
import json, socket
import numpy as np
import tensorflow as tf
import tfmem
tf1 = tf.compat.v1
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cluster = tf.train.ClusterSpec({"local": [f"127.0.0.1:{port}"]})
server = tf.distribute.Server(cluster, job_name="local", task_index=0)
g = tf.Graph()
with g.as_default():
    x = tf1.placeholder(tf.float32, [3])
    y = x
    for _ in range(6):
        y = tf.sin(y) * 2.0
config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
plain = tf1.Session(server.target, graph=g, config=config)
tfs = tfmem.TFMemSession(tf1.Session(server.target, graph=g, config=config), partition_size=100)
own = tfmem.Session(server.target, graph=g, config=config, partition_size=100)
graphs = tf1.RunOptions(output_partition_graphs=True)
counts = {}
for name, sess in (("plain", plain), ("tfmem", tfs), ("own", own)):
    md = tf1.RunMetadata()
    value = sess.run(y, {x: [1.0, 2.0, 3.0]}, options=graphs, run_metadata=md)
    with_option = len(md.partition_graphs)
    sess.run(y, {x: [1.0, 2.0, 3.0]}, run_metadata=md)
    counts[name] = [with_option, len(md.partition_graphs), value.tolist()]
print("TFMEM-RESULTS " + json.dumps(counts))
'''


def test_run_metadata_over_a_distributed_session():
    """TensorFlow's gRPC session drops a callable's run metadata; tfmem still returns it
    (a wrapped session's and a tfmem.Session's)."""
    from conftest import run_worker  # pylint: disable=import-outside-toplevel
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    counts = run_worker(_DISTRIBUTED, env, timeout=120)
    assert counts["plain"][0] > 0 and counts["plain"][1] == 0
    assert counts["tfmem"][0] == counts["plain"][0] and counts["tfmem"][1] == 0
    # tfmem.Session on the same server: its own session graph, the same answers
    assert counts["own"][:2] == counts["tfmem"][:2]
    np.testing.assert_allclose(counts["own"][2], counts["plain"][2], rtol=1e-6)
    np.testing.assert_allclose(counts["tfmem"][2], counts["plain"][2], rtol=1e-6)


def test_finalized_graph_stays_finalized(model):
    """tfmem adds its copies to a finalized graph; the program still cannot add ops."""
    g = model["w"].graph
    g.finalize()
    try:
        expected = model["plain"].run([model["loss"], model["h"]], model["feed"])
        got = model["tfs"].run([model["loss"], model["h"]], model["feed"])
        assert_same_result(expected, got)
        assert model["tfs"].last_step.partitions > 1
        assert g.finalized
        with pytest.raises(RuntimeError, match="finalized"):
            with g.as_default():
                tf.constant(1.0)
    finally:
        g._unsafe_unfinalize()  # pylint: disable=protected-access
