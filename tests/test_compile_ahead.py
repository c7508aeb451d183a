"""Compile ahead: a plan's first step runs each partition once its callable is made.

Results must equal plain `Session.run` bit for bit, a callable that cannot be
made must reach the user as TensorFlow's error naming the partition, and no
step may leave a thread making callables or a half-made list behind.
"""

import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem import tf_private
from tfmem.cli import models
from tfmem.run import compile_ahead

tf1 = tf.compat.v1
THREAD = "tfmem-compile-ahead"


def _config():
    config = tfmem.session_config()
    config.intra_op_parallelism_threads = 1
    config.inter_op_parallelism_threads = 1
    return config


def _ahead_threads():
    return [t for t in threading.enumerate() if t.name == THREAD]


def _chain(depth=12):
    """x -> `depth` elementwise layers -> (good: a sum, bad: a sum over an NCHW max pool,
    whose CPU kernel refuses the layout when it is built, i.e. when its callable is made)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [1, 1, 4, 4], name="x")
        h = x
        for _ in range(depth):
            h = tf.sin(h) + 0.5 * h
        good = tf.reduce_sum(h)
        bad = tf.reduce_sum(tf.nn.max_pool2d(h, 2, 2, "VALID", data_format="NCHW"))
    return g, x, good, bad


def test_training_steps_compiled_ahead_equal_plain_and_compiled_before():
    model = models.mlp(layers=4, width=64, features=64)
    fetches = [model.train, model.loss]
    losses = {}
    for mode in ("plain", "ahead", "before"):
        sess = tf1.Session(graph=model.graph, config=_config())
        sess.run(model.init)
        run = sess.run if mode == "plain" else tfmem.TFMemSession(
            sess, partition_size=20, compile_ahead=(mode == "ahead")).run
        losses[mode] = [run(fetches, model.feed(32, data_seed=i))[1] for i in range(3)]
        if mode != "plain":
            compiled = run.__self__.last_compile
            assert compiled.callables > 1
            # made during the first step: its wait is recorded; made before: None
            assert (compiled.callables_waited is not None) == (mode == "ahead"), compiled
        sess.close()
    assert losses["ahead"] == losses["plain"] == losses["before"], losses
    assert not _ahead_threads()


def test_compile_error_in_late_partition_reaches_user_and_session_still_works():
    g, x, good, bad = _chain()
    feed = {x: np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 1, 4, 4)}
    sess = tf1.Session(graph=g, config=_config())
    with pytest.raises(tf.errors.InvalidArgumentError):
        sess.run(bad, feed)  # plain TensorFlow refuses it too
    tfs = tfmem.TFMemSession(sess, partition_size=5)
    plan = tfs.plan(bad, feed)
    late = next(p.index for p in plan.partitions if "MaxPool2d" in p.ops)
    assert late >= 3, "the refused op must sit in a late partition"
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=f"(?s)NHWC.*partition {late} of {len(plan.partitions)}"):
        tfs.run(bad, feed)
    assert not _ahead_threads()
    # The failed step left no half-made callables: the next one makes them again
    # (here, in order) and fails the same way, naming the same partition.
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"partition {late} of"):
        tfs.run(bad, feed)
    # Other requests of the session run, and equal plain runs bit for bit.
    assert tfs.run(good, feed) == sess.run(good, feed)
    assert not _ahead_threads()
    tfs.close()


def test_a_step_failing_at_run_time_stops_the_thread_and_the_next_step_runs():
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        h = tf.debugging.check_numerics(tf.sqrt(x), "sqrt")  # fails at run time for x < 0
        for _ in range(12):
            h = tf.sin(h) + 0.5 * h
        out = tf.reduce_sum(h)
    sess = tf1.Session(graph=g, config=_config())
    tfs = tfmem.TFMemSession(sess, partition_size=4)
    with pytest.raises(tf.errors.InvalidArgumentError, match="sqrt"):
        tfs.run(out, {x: -np.ones(4, np.float32)})
    assert not _ahead_threads()
    feed = {x: np.arange(4, dtype=np.float32)}
    assert tfs.run(out, feed) == sess.run(out, feed)
    assert tfs.last_step.partitions > 2
    tfs.close()


def test_closing_the_session_during_a_first_step_stops_the_thread(monkeypatch):
    g, x, good, _ = _chain(depth=16)
    feed = {x: np.ones([1, 1, 4, 4], np.float32)}
    sess = tf1.Session(graph=g, config=_config())
    tfs = tfmem.TFMemSession(sess, partition_size=3)
    tfs.plan(good, feed)
    made = threading.Event()
    real = tf_private.make_callable

    def slow_make(session, options):  # slow enough that close() comes mid-way
        made.set()
        time.sleep(0.2)
        return real(session, options)

    monkeypatch.setattr(tf_private, "make_callable", slow_make)
    outcome = []

    def first_step():
        try:
            tfs.run(good, feed)
            outcome.append("ran")
        except Exception as err:  # pylint: disable=broad-except
            outcome.append(err)

    stepper = threading.Thread(target=first_step)
    stepper.start()
    assert made.wait(30)
    tfs.close()
    stepper.join(60)
    assert not stepper.is_alive()
    assert not _ahead_threads()
    assert len(outcome) == 1 and outcome[0] != "ran", outcome  # it could not finish


def test_callables_ahead_names_the_partition_and_keeps_earlier_ones():
    def make(program):
        if program == 2:
            raise tf.errors.InvalidArgumentError(None, None, "refused")
        return f"callable {program}"

    ahead = compile_ahead.CallablesAhead(make, range(4))
    ahead.enter()
    assert ahead[0] == "callable 0" and ahead[1] == "callable 1"
    with pytest.raises(tf.errors.InvalidArgumentError, match="(?s)refused.*partition 2 of 4"):
        ahead[3]  # pylint: disable=pointless-statement
    cache = {"key": ahead}
    assert compile_ahead.settle(cache, ahead) is None
    assert cache == {} and not ahead.running
