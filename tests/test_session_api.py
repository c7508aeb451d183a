"""TFMemSession.run takes what Session.run takes and returns the same values."""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import Point, assert_same_result, new_session

tf1 = tf.compat.v1


def _build():
    rs = np.random.RandomState(3)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 3], name="x")
        v = tf1.Variable(rs.standard_normal((3, 2)).astype(np.float32), use_resource=True, name="v")
        rv = tf1.Variable(rs.standard_normal((2,)).astype(np.float32), use_resource=False, name="rv")
        h = tf.matmul(x, v, name="h")
        y = h
        for i in range(5):
            y = tf.nn.relu(y * 1.5 + rv, name=f"y{i}")
        s = tf.reduce_sum(y, name="s")
        n = tf.shape(y, name="n")
        bump = tf1.assign_add(rv, [0.0, 0.0], name="bump").op
        sp = tf.SparseTensor(
            indices=tf.constant([[0, 0], [1, 2]], tf.int64),
            values=tf.reshape(s, [1]) * tf.constant([1.0, -2.0]),
            dense_shape=tf.constant([2, 3], tf.int64),
        )
        words = tf.strings.join([tf.constant(["a", "b"]), tf.strings.as_string(n)], name="words")
        init = tf1.global_variables_initializer()
    feed = {x: rs.standard_normal((2, 3)).astype(np.float32)}
    return dict(g=g, x=x, v=v, rv=rv, h=h, y=y, s=s, n=n, bump=bump, sp=sp, words=words, init=init, feed=feed)


@pytest.fixture
def env(pair):
    m = _build()
    plain, tfs = pair(m["g"], 2, m["init"])
    m["plain"], m["tfs"] = plain, tfs
    return m


def _both(m, fetches, feed_dict=None):
    feed_dict = m["feed"] if feed_dict is None else feed_dict
    return m["plain"].run(fetches, feed_dict=feed_dict), m["tfs"].run(fetches, feed_dict=feed_dict)


FETCHES = {
    "tensor": lambda m: m["s"],
    "list": lambda m: [m["s"], m["y"], m["n"]],
    "tuple": lambda m: (m["s"], m["h"]),
    "namedtuple": lambda m: Point(a=m["s"], b=m["y"]),
    "dict": lambda m: {"s": m["s"], "y": m["y"], 7: m["n"]},
    "ordered_dict": lambda m: collections.OrderedDict([("b", m["h"]), ("a", m["s"])]),
    "nested": lambda m: {"p": Point(a=[m["s"], (m["y"], m["n"])], b={"h": m["h"]}), "l": [[m["s"]], ()]},
    "empty_list": lambda m: [],
    "repeated": lambda m: [m["s"], m["s"], {"again": m["s"]}],
    "operation": lambda m: m["bump"],
    "op_in_list": lambda m: [m["bump"], m["s"]],
    "resource_variable": lambda m: m["v"],
    "ref_variable": lambda m: m["rv"],
    "variables_nested": lambda m: {"v": m["v"], "both": [m["v"], m["rv"]]},
    "tensor_name": lambda m: "s:0",
    "op_name": lambda m: "bump",
    "names_mixed": lambda m: ["y4:0", m["h"], "bump", ("n:0",)],
    "sparse": lambda m: m["sp"],
    "sparse_in_structure": lambda m: [m["sp"], {"s": m["s"]}],
    "strings": lambda m: [m["words"], m["n"]],
    "fed_tensor": lambda m: [m["x"], m["s"]],
    "fed_by_name": lambda m: "x:0",
}


@pytest.mark.parametrize("name", sorted(FETCHES))
def test_fetch_structures(env, name):
    fetches = FETCHES[name](env)
    exp, got = _both(env, fetches)
    assert_same_result(exp, got)


def test_fetch_sparse_returns_sparse_tensor_value(env):
    _, got = _both(env, env["sp"])
    assert isinstance(got, tf1.SparseTensorValue)


def test_fetch_operation_returns_none(env):
    _, got = _both(env, [env["bump"], "bump"])
    assert got == [None, None]


def test_fed_tensor_fetches_as_fed_value(env):
    hv = np.full((2, 2), 0.25, np.float32)
    feed = {env["x"]: env["feed"][env["x"]], env["h"]: hv}
    exp, got = _both(env, [env["h"], env["x"], env["y"]], feed)
    assert_same_result(exp, got)
    np.testing.assert_array_equal(got[0], hv)
    np.testing.assert_array_equal(got[1], env["feed"][env["x"]])


@pytest.mark.parametrize("key", ["tensor", "name"])
def test_feed_keys_as_tensors_or_names(env, key):
    xv = env["feed"][env["x"]]
    hv = np.ones((2, 2), np.float32)
    feed = {env["x"]: xv} if key == "tensor" else {"x:0": xv}
    assert_same_result(*_both(env, [env["s"], env["y"]], feed))
    feed = {env["h"]: hv} if key == "tensor" else {"h:0": hv}
    assert_same_result(*_both(env, [env["s"], env["y"]], feed))


def test_feed_values_as_python_lists_and_scalars(env):
    feed = {env["x"]: [[1, 2, 3], [4, 5, 6]]}
    assert_same_result(*_both(env, env["y"], feed))


def test_feed_sparse_placeholder(pair):
    g = tf.Graph()
    with g.as_default():
        sp = tf1.sparse_placeholder(tf.float32, shape=[3, 4], name="sp")
        d = tf.sparse.to_dense(sp)
        out = d
        for _ in range(4):
            out = out * 2.0 + 1.0
        tot = tf.sparse.reduce_sum(sp)
    plain, tfs = pair(g, 2)
    value = tf1.SparseTensorValue(np.array([[0, 1], [2, 3]], np.int64), np.array([1.5, -2.0], np.float32), np.array([3, 4], np.int64))
    assert_same_result(plain.run([out, tot, sp], feed_dict={sp: value}), tfs.run([out, tot, sp], feed_dict={sp: value}))


def test_options_and_run_metadata(env):
    options = tf1.RunOptions(trace_level=tf1.RunOptions.FULL_TRACE)
    md_plain, md_tfs = tf1.RunMetadata(), tf1.RunMetadata()
    exp = env["plain"].run([env["s"], env["y"]], feed_dict=env["feed"], options=options, run_metadata=md_plain)
    got = env["tfs"].run([env["s"], env["y"]], feed_dict=env["feed"], options=options, run_metadata=md_tfs)
    assert_same_result(exp, got)
    assert md_plain.step_stats.dev_stats
    assert md_tfs.step_stats.dev_stats


def test_run_by_keyword_arguments(env):
    exp = env["plain"].run(fetches=env["s"], feed_dict=env["feed"])
    got = env["tfs"].run(fetches=env["s"], feed_dict=env["feed"])
    assert_same_result(exp, got)


# --------------------------------------------------------------------------
# errors: what Session.run raises for the same mistake


def _plain_exception(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


def test_feed_of_wrong_shape_raises_value_error(env):
    bad = {env["x"]: np.zeros((3, 3), np.float32)}
    plain_exc = _plain_exception(lambda: env["plain"].run(env["s"], feed_dict=bad))
    assert isinstance(plain_exc, ValueError)
    with pytest.raises(ValueError):
        env["tfs"].run(env["s"], feed_dict=bad)
    bad_intermediate = {env["h"]: np.zeros((2, 5), np.float32)}
    with pytest.raises(ValueError):
        env["plain"].run(env["s"], feed_dict=bad_intermediate)
    with pytest.raises(ValueError):
        env["tfs"].run(env["s"], feed_dict=bad_intermediate)


def _other_graph():
    other = tf.Graph()
    with other.as_default():
        t = tf.constant(1.0, name="t")
        p = tf1.placeholder(tf.float32, [2, 3], name="p")
        op = tf.no_op(name="nop")
    return t, p, op


OTHER_GRAPH_CASES = {
    "fetch_tensor": lambda m, o: (o[0], m["feed"]),
    "fetch_in_list": lambda m, o: ([m["s"], o[0]], m["feed"]),
    "fetch_operation": lambda m, o: (o[2], m["feed"]),
    "feed_key": lambda m, o: (m["s"], {**m["feed"], o[1]: np.zeros((2, 3), np.float32)}),
    "unknown_name": lambda m, o: ("no_such_op:0", m["feed"]),
    "unknown_feed_name": lambda m, o: (m["s"], {**m["feed"], "no_such:0": 1.0}),
}


@pytest.mark.parametrize("case", sorted(OTHER_GRAPH_CASES))
def test_element_of_another_graph_raises_like_session(env, case):
    fetches, feed = OTHER_GRAPH_CASES[case](env, _other_graph())
    plain_exc = _plain_exception(lambda: env["plain"].run(fetches, feed_dict=feed))
    with pytest.raises(Exception) as info:
        env["tfs"].run(fetches, feed_dict=feed)
    assert type(info.value) is type(plain_exc), f"plain raised {plain_exc!r}, tfmem raised {info.value!r}"


@pytest.mark.parametrize("bad", [3, None, 2.5, object(), [None], {"a": 3}], ids=["int", "None", "float", "object", "list_None", "dict_int"])
def test_unfetchable_raises_type_error(env, bad):
    plain_exc = _plain_exception(lambda: env["plain"].run(bad))
    assert isinstance(plain_exc, TypeError)
    with pytest.raises(TypeError):
        env["tfs"].run(bad)


def test_unfed_placeholder_raises_invalid_argument(env):
    with pytest.raises(tf.errors.InvalidArgumentError):
        env["plain"].run(env["s"])
    with pytest.raises(tf.errors.InvalidArgumentError):
        env["tfs"].run(env["s"])


def test_unfed_placeholder_deep_in_graph(pair):
    """The placeholder is needed only by a late partition."""
    g = tf.Graph()
    with g.as_default():
        counter = tf1.Variable(0, use_resource=True, name="counter")
        with tf.control_dependencies([counter.assign_add(1)]):
            a = tf.identity(tf.constant(1.0))
        for _ in range(6):
            a = a * 2.0
        late = tf1.placeholder(tf.float32, [], name="late")
        out = a + late
        init = tf1.global_variables_initializer()
    plain, tfs = pair(g, 2, init)
    with pytest.raises(tf.errors.InvalidArgumentError):
        plain.run(out)
    with pytest.raises(tf.errors.InvalidArgumentError):
        tfs.run(out)
    # the wrapper still works afterwards
    assert_same_result(plain.run(out, feed_dict={late: 0.5}), tfs.run(out, feed_dict={late: 0.5}))


@pytest.mark.parametrize("size", [0, -1, 2.5, "10", True, False], ids=repr)
def test_bad_partition_size_raises_value_error(size):
    g = tf.Graph()
    sess = new_session(g)
    try:
        with pytest.raises(ValueError, match="partition_size"):
            tfmem.TFMemSession(sess, partition_size=size)
    finally:
        sess.close()


def test_tfmem_error_hierarchy():
    assert issubclass(tfmem.InvalidPlanError, tfmem.TFMemError)
    assert issubclass(tfmem.TFMemError, Exception)


# --------------------------------------------------------------------------
# lifecycle


def test_close_then_run_raises_runtime_error(env):
    tfs = env["tfs"]
    tfs.run(env["s"], feed_dict=env["feed"])
    tfs.close()
    with pytest.raises(RuntimeError):
        tfs.run(env["s"], feed_dict=env["feed"])
    # a request never run before fails the same way
    with pytest.raises(RuntimeError):
        tfs.run(env["n"], feed_dict=env["feed"])
    sess = tf1.Session(graph=env["g"])
    sess.close()
    with pytest.raises(RuntimeError):
        sess.run(env["s"], feed_dict=env["feed"])


def test_context_manager(pair):
    m = _build()
    plain = new_session(m["g"])
    try:
        plain.run(m["init"])
        exp = plain.run(m["y"], feed_dict=m["feed"])
        sess = new_session(m["g"])
        with tfmem.TFMemSession(sess, partition_size=2) as tfs:
            assert isinstance(tfs, tfmem.TFMemSession)
            assert tfs.session is sess and tfs.graph is m["g"]
            tfs.run(m["init"])
            assert_same_result(exp, tfs.run(m["y"], feed_dict=m["feed"]))
        with pytest.raises(RuntimeError):
            tfs.run(m["y"], feed_dict=m["feed"])
    finally:
        plain.close()


def test_context_manager_propagates_exceptions():
    g = tf.Graph()
    with g.as_default():
        c = tf.constant(1.0)
    sess = new_session(g)
    with pytest.raises(KeyError, match="boom"):
        with tfmem.TFMemSession(sess, partition_size=3) as tfs:
            assert tfs.run(c) == 1.0
            raise KeyError("boom")


def test_feed_not_needed_by_fetches(env):
    """Session.run accepts feeds for tensors the fetches do not need."""
    feed = {**env["feed"], env["h"]: np.ones((2, 2), np.float32)}
    assert_same_result(*_both(env, env["n"], {env["h"]: np.ones((2, 2), np.float32)}))
    assert_same_result(*_both(env, env["v"], feed))


def test_feed_tuple_key(pair):
    g = tf.Graph()
    with g.as_default():
        a = tf1.placeholder(tf.float32, [2], name="a")
        b = tf1.placeholder(tf.float32, [2], name="b")
        out = a * b
        for _ in range(4):
            out = out + a
    plain, tfs = pair(g, 2)
    feed = {(a, b): (np.array([1.0, 2.0], np.float32), np.array([3.0, 4.0], np.float32))}
    assert_same_result(plain.run(out, feed_dict=feed), tfs.run(out, feed_dict=feed))


def _long_lived_activation_graph():
    """A tensor produced first and read last, far more than swap_distance partitions later."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [512, 1024], name="x")
        early = tf.sin(x, name="early")
        h = early
        for i in range(12):
            h = tf.cos(h, name=f"h{i}")
        out = tf.reduce_sum(h + early, name="out")
    return graph, x, out


def test_auto_swaps_nothing_without_device_memory(monkeypatch):
    """A plain CPU session's "device" is host memory: auto keeps tensors, all still swaps."""
    monkeypatch.undo()  # the conftest fixture pretends to have an accelerator
    graph, x, out = _long_lived_activation_graph()
    feed = {x: np.ones([512, 1024], np.float32)}
    with new_session(graph) as sess:
        expected = sess.run(out, feed)
        auto = tfmem.TFMemSession(sess, partition_size=2, options=tfmem.Options(swap_min_bytes=0))
        forced = tfmem.TFMemSession(sess, partition_size=2, swap="all")
        assert auto.plan(out, feed).policy.mode == "none"
        assert not any(t.swapped for t in auto.plan(out, feed).transfers)
        assert any(t.swapped for t in forced.plan(out, feed).transfers)
        for tfs in (auto, forced):
            np.testing.assert_allclose(tfs.run(out, feed), expected, rtol=1e-5)
        assert auto.last_step.swapped_out == 0 and forced.last_step.swapped_out > 0


@pytest.mark.parametrize("dtype,value", [(tf.string, 5), (tf.string, True), (tf.int32, 2 ** 40),
                                          (tf.int32, 2 ** 70), (tf.int32, True), (tf.string, b"ok")],
                         ids=["int_to_string", "bool_to_string", "int32_overflow",
                              "beyond_int64", "bool_to_int", "bytes_to_string"])
def test_python_scalar_feeds_like_session(pair, dtype, value):
    """Session.run's own checks: a Python int that does not survive conversion to the
    placeholder's type (to a string above all) raises the same error, with the same text."""
    g = tf.Graph()
    with g.as_default():
        p = tf1.placeholder(dtype, [], name="p")
        out = tf.identity(p)
        for _ in range(3):
            out = tf.identity(out)
    plain, tfs = pair(g, 2)
    try:
        expected = plain.run(out, feed_dict={p: value})
    except Exception as plain_error:  # pylint: disable=broad-except
        with pytest.raises(type(plain_error)) as info:
            tfs.run(out, feed_dict={p: value})
        assert str(info.value) == str(plain_error)
    else:
        assert_same_result(expected, tfs.run(out, feed_dict={p: value}))
