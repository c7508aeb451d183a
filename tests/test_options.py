"""tfmem.Options: the rarely changed settings in one checked value that both front ends
take; their old keyword spellings still work, with a DeprecationWarning naming the new
one and pointing at the caller's line."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import tfmem

tf1 = tf.compat.v1


def _graph():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [8, 8], name="x")
        h = x
        for i in range(6):
            h = tf.tanh(tf.matmul(h, h) * 0.1 + float(i))
        out = tf.reduce_sum(h, name="out")
    return g, x, out


def _deprecations(record):
    return [w for w in record if issubclass(w.category, DeprecationWarning)
            and "options=tfmem.Options(" in str(w.message)]


@pytest.mark.parametrize("field, bad", [
    ("swap_min_bytes", -1), ("swap_min_bytes", 1.5), ("measure", "sometimes"),
    ("partial_runs", "yes"), ("chain_copies", None), ("atomic_updates", "on"),
    ("accelerator_device", 1),
])
def test_a_bad_field_is_refused_when_the_options_are_made(field, bad):
    with pytest.raises(ValueError, match=field):
        tfmem.Options(**{field: bad})


def test_old_session_keywords_warn_and_run_as_the_options_do():
    g, x, out = _graph()
    feed = {x: np.full((8, 8), 0.3, np.float32)}
    plain = tf1.Session(graph=g).run(out, feed)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = tfmem.TFMemSession(tf1.Session(graph=g), partition_size=3, swap="all",
                                 swap_min_bytes=0, measure="off")
    [warning] = _deprecations(record)
    assert "TFMemSession(swap_min_bytes=0, measure='off') is deprecated" in str(warning.message)
    assert "options=tfmem.Options(swap_min_bytes=0, measure='off')" in str(warning.message)
    assert warning.filename == __file__  # the caller's line, not tfmem's
    new = tfmem.TFMemSession(tf1.Session(graph=g), partition_size=3, swap="all",
                             options=tfmem.Options(swap_min_bytes=0, measure="off"))
    assert old.plan(out, feed) == new.plan(out, feed)
    assert old.plan(out, feed).policy.min_bytes == 0
    assert any(t.swapped for t in old.plan(out, feed).transfers)
    np.testing.assert_array_equal(old.run(out, feed), plain)
    np.testing.assert_array_equal(new.run(out, feed), plain)


def test_tfmem_session_and_session_creator_warn_at_the_callers_line():
    g, _, _ = _graph()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tfmem.Session(graph=g, place_state_on_host=False).close()
        tfmem.SessionCreator(swap_min_bytes=0)
    warned = _deprecations(record)
    assert [w.filename for w in warned] == [__file__, __file__]
    assert "tfmem.Session(place_state_on_host=False) is deprecated" in str(warned[0].message)
    assert "tfmem.SessionCreator(swap_min_bytes=0) is deprecated" in str(warned[1].message)


def test_old_function_keywords_warn_and_run_as_the_options_do():
    v = tf.Variable(np.ones((8, 8), np.float32))

    def step(x):
        h = x
        for _ in range(6):
            h = tf.tanh(tf.matmul(h, v) * 0.1)
        return tf.reduce_sum(h)

    x = tf.constant(np.full((8, 8), 0.3, np.float32))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        old = tfmem.function(step, partition_size=3, swap="all", swap_min_bytes=0)
    [warning] = _deprecations(record)
    assert "tfmem.function(swap_min_bytes=0) is deprecated" in str(warning.message)
    assert warning.filename == __file__
    new = tfmem.function(step, partition_size=3, swap="all",
                         options=tfmem.Options(swap_min_bytes=0))
    assert old.plan(x).policy.min_bytes == 0 and new.plan(x).policy.min_bytes == 0
    assert any(t.swapped for t in old.plan(x).transfers)
    expected = tf.function(step)(x).numpy()
    assert old(x).numpy() == expected and new(x).numpy() == expected


def test_keras_partitioned_warns_once_at_the_callers_line():
    import keras  # pylint: disable=import-outside-toplevel
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        tfmem.keras.partitioned(model, partition_size=5, swap_min_bytes=0)
        model.fit(np.ones((4, 4), np.float32), np.ones((4, 2), np.float32), verbose=0)
    [warning] = _deprecations(record)
    assert "tfmem.keras.partitioned(swap_min_bytes=0) is deprecated" in str(warning.message)
    assert warning.filename == __file__
    assert tfmem.keras.train_step_of(model).last_step.partitions > 1


@pytest.mark.parametrize("front_end, field, value", [
    ("function", "partial_runs", True), ("function", "measure", "every"),
    ("function", "chain_copies", False), ("session", "profile_peaks", True),
])
def test_a_field_the_front_end_does_not_read_is_refused(front_end, field, value):
    options = tfmem.Options(**{field: value})
    with pytest.raises(ValueError, match=f"Options.{field} is read by"):
        if front_end == "function":
            tfmem.function(lambda: 1.0, options=options)
        else:
            tfmem.TFMemSession(tf1.Session(graph=_graph()[0]), options=options)


def test_internal_wiring_and_wrong_types_are_refused():
    g, _, _ = _graph()
    with pytest.raises(TypeError, match="graph_copy"):
        tfmem.TFMemSession(tf1.Session(graph=g), graph_copy=None)
    with pytest.raises(TypeError, match="tfmem.Options"):
        tfmem.TFMemSession(tf1.Session(graph=g), options={"measure": "off"})
    with pytest.raises(TypeError, match="tfmem.Options"):
        tfmem.function(lambda: 1.0, options={"profile_peaks": True})
