"""Concurrent `run` calls on one TFMemSession give plain Session.run's results.

Session.run may be called from several threads at once; so may tfmem's.
Each step has its own swap manager (handles, host buffers, uploads), while
the plan cache, compiled callables, buffer pool and prefetch thread are
shared.  The threads start together (a barrier), so the first step of a
request is planned and compiled while other threads ask for it too.
"""

import threading

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.plan import stretches
from conftest import assert_same_result

tf1 = tf.compat.v1

THREADS = 4
STEPS = 8
SIZE = 32


def build():
    """x -> a chain read again at the end (transfers to swap), and a counter bumped per run."""
    rs = np.random.RandomState(0)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, SIZE], name="x")
        w = tf1.Variable(rs.standard_normal((SIZE, SIZE)).astype(np.float32) * 0.2, name="w",
                         use_resource=True)
        counter = tf1.Variable(0, dtype=tf.int64, name="counter", use_resource=True)
        bump = counter.assign_add(1, read_value=False)
        first = tf.tanh(tf.matmul(x, w), name="first")
        h = first
        for i in range(6):
            h = tf.sin(h * 0.9 + first, name=f"h{i}")
        out = tf.reduce_sum(h * first, axis=1, name="out")
        other = tf.reduce_max(tf.matmul(h, w) + first, name="other")
        init = tf1.global_variables_initializer()
    feeds = [rs.standard_normal((4 + i % 3, SIZE)).astype(np.float32)
             for i in range(THREADS * STEPS)]
    return g, x, out, other, bump, counter, init, feeds


def _run_threads(work):
    """Run work(thread index) on THREADS threads started together; re-raise their errors."""
    barrier = threading.Barrier(THREADS)
    errors = []

    def target(index):
        try:
            barrier.wait()
            work(index)
        except BaseException as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    if errors:
        raise errors[0]


def test_concurrent_runs_match_plain(sessions):
    g, x, out, other, bump, counter, init, feeds = build()
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=2, swap="all", prefetch=1,
                             options=tfmem.Options(swap_min_bytes=0))
    plain.run(init)
    tfs.run(init)
    # two requests, so threads also plan and run different plans side by side
    requests = [[out, bump], [out, other, bump]]
    expected = [plain.run(requests[i % 2][:-1], feed_dict={x: feed})
                for i, feed in enumerate(feeds)]
    got = [None] * len(feeds)

    def work(thread):
        for step in range(STEPS):
            i = thread * STEPS + step
            got[i] = tfs.run(requests[i % 2], feed_dict={x: feeds[i]})[:-1]

    _run_threads(work)
    plan = tfs.plan(requests[1], feed_dict={x: feeds[0]})
    assert len(plan.partitions) > 3 and any(t.swapped for t in plan.transfers)
    for e, r in zip(expected, got):
        assert_same_result(e, r)
    assert tfs.run(counter) == len(feeds)  # every run bumped the counter exactly once
    assert tfs.host_buffers.in_use_bytes == 0


def test_concurrent_failures_release_their_steps(sessions):
    """Threads whose steps fail (an unfed placeholder deep in the graph) beside good ones."""
    g, x, out, _, _, _, init, feeds = build()
    with g.as_default():
        scale = tf1.placeholder(tf.float32, [], name="scale")
        checked = tf.debugging.check_numerics(out * tf.math.log(scale), "bad scale")
        late = tf.reduce_sum(tf.tanh(checked) + out)
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=2, swap="all", prefetch=2,
                             options=tfmem.Options(swap_min_bytes=0))
    plain.run(init)
    tfs.run(init)
    outcomes = [None] * len(feeds)

    def work(thread):
        for step in range(STEPS):
            i = thread * STEPS + step
            try:
                outcomes[i] = tfs.run(late, feed_dict={x: feeds[i], scale: -1.0 if i % 3 else 2.0})
            except tf.errors.InvalidArgumentError as err:
                assert "bad scale" in str(err)
                outcomes[i] = "failed"

    _run_threads(work)
    for i, feed in enumerate(feeds):
        if i % 3:
            assert outcomes[i] == "failed"
        else:
            assert_same_result(plain.run(late, feed_dict={x: feed, scale: 2.0}), outcomes[i])
    assert tfs.host_buffers.in_use_bytes == 0
    assert_same_result(plain.run(out, feed_dict={x: feeds[0]}), tfs.run(out, feed_dict={x: feeds[0]}))


def test_concurrent_first_steps_with_new_run_options_compile_once(sessions, monkeypatch):
    """Threads that all bring the same new RunOptions at once share one set of callables:
    each stretch of partitions is compiled once for them, not once per thread."""
    g, x, out, _, _, _, init, feeds = build()
    plain = sessions(g)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=2, options=tfmem.Options(measure="off"))
    plain.run(init)
    tfs.run(init)
    tfs.run(out, feed_dict={x: feeds[0]})  # plan and callables for the default options
    calls = len(stretches.stretches(tfs.plan(out, feed_dict={x: feeds[0]})))
    made = []
    original = tfmem.tf_private.make_callable

    def slow_make_callable(session, options):
        made.append(options.run_options.timeout_in_ms)
        threading.Event().wait(0.02)  # widen the window in which threads race
        return original(session, options)

    monkeypatch.setattr(tfmem.tf_private, "make_callable", slow_make_callable)
    options = tf1.RunOptions(timeout_in_ms=600000)
    got = [None] * THREADS

    def work(thread):
        got[thread] = tfs.run(out, feed_dict={x: feeds[thread]}, options=options)

    _run_threads(work)
    assert made.count(600000) == calls, made
    for thread in range(THREADS):
        assert_same_result(plain.run(out, feed_dict={x: feeds[thread]}), got[thread])
