"""Swap policy and swap manager: spans, validation, equivalence and step stats.

* ``tfmem.plan.swap.spans`` is pure: checked case by case and by properties over
  a grid of policies and reader sets.
* ``tfmem.validate`` rejects plans whose spans are broken (built with
  ``dataclasses.replace`` from a valid plan).
* Every swap mode and prefetch distance returns what plain ``Session.run``
  returns, for training (Adam) and for v1/v2 while loops.
* ``StepStats`` counts what the plan says is swapped, in bytes for static
  shapes; its device peak is TensorFlow's own figure for that step (None
  where the allocator keeps none), checked under an emulated cap in a
  subprocess.
"""

import dataclasses
import itertools
import json
import os

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.plan import stretches
from tfmem.plan.swap import Span, SwapPolicy, spans
from tfmem.run.placement import accelerator
from conftest import (ATOL, RTOL, assert_same_result, build_mlp, check_plan, new_session,
                      run_worker)

tf1 = tf.compat.v1

MODES = ("auto", "all", "none")


# --------------------------------------------------------------------------
# helpers


@pytest.fixture
def swap_pair(sessions):
    """Factory: ``make(graph, partition_size, init=None, **swap)`` -> (plain, tfs)."""

    def make(graph, partition_size, init=None, **swap):
        plain = sessions(graph)
        tfs = tfmem.TFMemSession(sessions(graph), partition_size=partition_size, **swap)
        if init is not None:
            plain.run(init)
            tfs.run(init)
        return plain, tfs

    return make


def _swap_kwargs(mode, prefetch):
    """Settings under which "auto" swaps some of these tiny tensors and keeps others."""
    kwargs = dict(swap=mode, prefetch=prefetch)
    if mode == "auto":
        kwargs.update(swap_distance=1, options=tfmem.Options(swap_min_bytes=0))
    return kwargs


def _assert_swapping_as_asked(plan, mode):
    swapped = [t for t in plan.transfers if t.swapped]
    if mode == "none":
        assert not swapped, f"swap='none' swapped {[t.tensor for t in swapped]}"
        assert all(len(t.spans) == 1 and t.kept for t in plan.transfers)
    elif mode == "all":
        assert swapped, "swap='all' swapped nothing"
    else:
        assert swapped, "swap='auto' swapped nothing"
        assert any(not t.swapped for t in plan.transfers), "swap='auto' swapped everything"
    assert plan.policy.mode == mode


def _nbytes(graph, name):
    t = graph.get_tensor_by_name(name)
    assert t.shape.is_fully_defined(), name
    return int(np.prod(t.shape.as_list(), dtype=np.int64)) * t.dtype.size


# --------------------------------------------------------------------------
# spans(): pure


def P(mode="auto", swap_distance=2, prefetch=1):
    return SwapPolicy(mode, swap_distance, prefetch)


SPAN_CASES = [
    # (producer, readers, policy, can_swap, expected spans)
    (0, (1, 2, 3), P("auto"), True, [Span(0, (1, 2, 3), False)]),
    (0, (2,), P("auto"), True, [Span(0, (2,), False)]),  # gap == distance: kept
    (0, (3,), P("auto"), True, [Span(2, (3,), True)]),  # gap > distance: swapped
    (0, (1,), P("auto", swap_distance=0), True, [Span(1, (1,), True)]),
    (0, (1, 2, 7, 8, 20), P("auto", 2, 1), True,
     [Span(0, (1, 2), False), Span(6, (7, 8), True), Span(19, (20,), True)]),
    (0, (1, 2, 7, 8, 20), P("auto", 2, 3), True,
     [Span(0, (1, 2), False), Span(4, (7, 8), True), Span(17, (20,), True)]),
    (0, (1, 2, 7, 8, 20), P("auto", 2, 0), True,
     [Span(0, (1, 2), False), Span(7, (7, 8), True), Span(20, (20,), True)]),
    (5, (8, 9, 10), P("auto", 3, 2), True, [Span(5, (8, 9, 10), False)]),
    (5, (9, 10, 11), P("auto", 3, 2), True, [Span(7, (9, 10, 11), True)]),
    # prefetch reaching back past the producer: the upload starts right after it
    (4, (6,), P("auto", 0, 3), True, [Span(5, (6,), True)]),
    (4, (5,), P("all", 2, 3), True, [Span(5, (5,), True)]),
    (2, (3, 5, 9), P("all", 2, 1), True,
     [Span(3, (3,), True), Span(4, (5,), True), Span(8, (9,), True)]),
    (2, (3, 5, 9), P("all", 2, 0), True,
     [Span(3, (3,), True), Span(5, (5,), True), Span(9, (9,), True)]),
    (0, (1, 5, 30), P("none", 0, 3), True, [Span(0, (1, 5, 30), False)]),
    # cannot swap (strings, variants): kept whatever the policy
    (0, (1, 5, 30), P("all", 0, 3), False, [Span(0, (1, 5, 30), False)]),
    (0, (9,), P("auto", 0, 1), False, [Span(0, (9,), False)]),
]


@pytest.mark.parametrize("producer, readers, policy, can_swap, expected", SPAN_CASES)
def test_spans_cases(producer, readers, policy, can_swap, expected):
    got = spans(producer, readers, policy, can_swap)
    assert isinstance(got, tuple)
    assert got == tuple(expected)


def _reader_sets(rs, count=40):
    sets = [(1,), (2,), (1, 2), (1, 2, 3), (3, 4, 9), (1, 9, 10, 11, 25)]
    for _ in range(count):
        size = rs.randint(1, 7)
        sets.append(tuple(sorted(rs.choice(np.arange(1, 20), size=size, replace=False).tolist())))
    return sets


@pytest.mark.parametrize("mode", MODES)
def test_spans_properties(mode):
    """Readers covered once in order; uploads after the producer; gaps decide swaps."""
    rs = np.random.RandomState(1)
    checked = 0
    for distance, prefetch, can_swap, producer in itertools.product(
            (0, 1, 2, 5), (0, 1, 3), (True, False), (0, 3)):
        policy = SwapPolicy(mode, distance, prefetch)
        for offsets in _reader_sets(rs, 10):
            readers = tuple(producer + r for r in offsets)
            got = spans(producer, readers, policy, can_swap)
            context = f"{policy} producer={producer} readers={readers} can_swap={can_swap}: {got}"
            assert all(isinstance(s, Span) for s in got), context
            # every reader exactly once, in order, no empty span
            assert [r for s in got for r in s.readers] == list(readers), context
            assert all(s.readers for s in got), context
            # only the first span can be the producer's own copy
            for i, s in enumerate(got):
                if s.uploaded:
                    assert producer < s.start <= s.readers[0], context
                    # prefetch ahead, but never before the previous reader (no overlapping copies)
                    previous = got[i - 1].readers[-1] if i else producer
                    assert s.start == max(s.readers[0] - prefetch, producer + 1, previous), context
                else:
                    assert i == 0 and s.start == producer, context
            assert [s.start for s in got] == sorted(s.start for s in got), context
            # which gaps are swapped
            swaps_everything = can_swap and mode == "all"
            keeps_everything = not can_swap or mode == "none"
            if keeps_everything:
                assert got == (Span(producer, readers, False),), context
            elif swaps_everything:
                assert all(s.uploaded and len(s.readers) == 1 for s in got), context
            else:  # auto: a new (uploaded) span exactly where a gap exceeds the distance
                previous = producer
                starts_new = []
                for r in readers:
                    starts_new.append(r - previous > distance)
                    previous = r
                firsts = [s.readers[0] for s in got]
                assert [r for r, new in zip(readers, starts_new) if new] == \
                    [s.readers[0] for s in got if s.uploaded], context
                assert got[0].uploaded == starts_new[0], context
                assert set(firsts[1:]) <= {r for r, new in zip(readers, starts_new) if new}, context
            checked += 1
    assert checked > 500


# --------------------------------------------------------------------------
# bad settings


@pytest.mark.parametrize("mode", ["ALL", "never", "", None, "swap", 1])
def test_unknown_swap_mode_is_rejected(mode):
    with pytest.raises(ValueError) as policy_error:
        SwapPolicy(mode, 2, 1)
    g = tf.Graph()
    with g.as_default():
        tf.constant(1.0)
    sess = new_session(g)
    try:
        with pytest.raises(ValueError) as session_error:
            tfmem.TFMemSession(sess, partition_size=3, swap=mode)
    finally:
        sess.close()
    for err in (policy_error.value, session_error.value):
        message = str(err)
        assert "swap" in message
        for accepted in MODES:
            assert repr(accepted) in message or f'"{accepted}"' in message, message


@pytest.mark.parametrize("name", ["swap_distance", "prefetch"])
@pytest.mark.parametrize("value", [-1, -10, 1.0, 2.5, "1", None, True, False])
def test_bad_distances_are_rejected(name, value):
    with pytest.raises(ValueError, match=name) as policy_error:
        SwapPolicy(**{"mode": "auto", name: value})
    g = tf.Graph()
    with g.as_default():
        tf.constant(1.0)
    sess = new_session(g)
    try:
        with pytest.raises(ValueError, match=name) as session_error:
            tfmem.TFMemSession(sess, partition_size=3, **{name: value})
    finally:
        sess.close()
    for err in (policy_error.value, session_error.value):
        assert ">= 0" in str(err) and "integer" in str(err), str(err)


@pytest.mark.parametrize("value", [0, 1, 3, 100])
def test_good_distances_are_kept(value):
    policy = SwapPolicy("all", value, value)
    assert (policy.mode, policy.swap_distance, policy.prefetch) == ("all", value, value)


# --------------------------------------------------------------------------
# validate() rejects broken spans


def _chain_graph():
    """x -> a -> b -> c -> d with a read by b and again by d (two readers, a gap)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, 4], name="x")
        a = tf.tanh(x, name="a")
        b = tf.sin(a, name="b")
        c = tf.cos(b, name="c")
        e = tf.exp(c, name="e")
        d = tf.add(e, a, name="d")
        out = tf.reduce_sum(d, name="out")
        s = tf.strings.as_string(a, name="s")
        n = tf.strings.length(tf.strings.join([s, s], name="sj"), name="n")
        out2 = tf.reduce_sum(n, name="out2")
    return g, x, out, out2


@pytest.fixture
def valid_plan(sessions):
    g, x, out, out2 = _chain_graph()
    tfs = tfmem.TFMemSession(sessions(g), partition_size=1, swap="all", prefetch=1)
    plan = tfs.plan([out, out2], feed_dict={x: np.ones((4, 4), np.float32)})
    assert tfmem.validate(plan) is None
    return plan


def _with_spans(plan, transfer, new_spans):
    changed = dataclasses.replace(transfer, spans=tuple(new_spans))
    return dataclasses.replace(
        plan, transfers=tuple(changed if t is transfer else t for t in plan.transfers))


def _multi_reader(plan):
    transfer = next((t for t in plan.transfers
                     if len(t.consumers) >= 2 and t.swapped and t.consumers[1] - t.consumers[0] > 1),
                    None)
    assert transfer is not None, [(t.tensor, t.consumers) for t in plan.transfers]
    return transfer


BROKEN_SPANS = {
    "readers out of order": lambda t: [Span(t.producer + 1, tuple(reversed(t.consumers)), True)],
    "a reader twice": lambda t: [Span(t.consumers[0], t.consumers[:1], True),
                                 Span(t.consumers[0], t.consumers, True)],
    "a reader missing": lambda t: [Span(t.consumers[0], t.consumers[:1], True)],
    "an unknown reader": lambda t: [Span(t.consumers[0], t.consumers + (t.consumers[-1] + 1,), True)],
    "an empty span": lambda t: [Span(t.consumers[0], (), True),
                                Span(t.consumers[0], t.consumers, True)],
    "no spans": lambda t: [],
    "upload during the producer": lambda t: [Span(t.producer, t.consumers, True)],
    "upload before the producer": lambda t: [Span(t.producer - 1, t.consumers, True)],
    "upload after its first reader": lambda t: [Span(t.consumers[0] + 1, t.consumers, True)],
    "kept copy that the producer did not make": lambda t: [Span(t.producer + 1, t.consumers, False)],
    # the producer's copy is freed by the first span's last reader: a second
    # span cannot be that copy again
    "producer's copy read after it was freed": lambda t: [
        Span(t.producer, t.consumers[:1], False), Span(t.producer, t.consumers[1:], False)],
    "kept copy after an upload": lambda t: [
        Span(t.consumers[0], t.consumers[:1], True), Span(t.producer, t.consumers[1:], False)],
}


@pytest.mark.parametrize("case", sorted(BROKEN_SPANS))
def test_validate_rejects_broken_spans(valid_plan, case):
    transfer = _multi_reader(valid_plan)
    if transfer.producer == 0 and case == "upload before the producer":
        transfer = next(t for t in valid_plan.transfers if t.producer > 0)
    broken = _with_spans(valid_plan, transfer, BROKEN_SPANS[case](transfer))
    with pytest.raises(tfmem.InvalidPlanError) as err:
        tfmem.validate(broken)
    assert transfer.tensor in str(err.value)
    assert isinstance(err.value, tfmem.TFMemError)


def test_validate_rejects_swapped_string(valid_plan):
    strings = [t for t in valid_plan.transfers
               if valid_plan.view.tensor(t.tensor).dtype == tf.string]
    assert strings and not any(t.swapped for t in strings)
    t = strings[0]
    broken = _with_spans(valid_plan, t, [Span(r, (r,), True) for r in t.consumers])
    with pytest.raises(tfmem.InvalidPlanError, match="string"):
        tfmem.validate(broken)


def test_validate_accepts_other_valid_spans(valid_plan):
    """Keeping a swappable tensor instead of swapping it is a valid plan too."""
    transfer = _multi_reader(valid_plan)
    kept = _with_spans(valid_plan, transfer, [Span(transfer.producer, transfer.consumers, False)])
    assert tfmem.validate(kept) is None
    prefetched = _with_spans(valid_plan, transfer,
                             [Span(transfer.producer + 1, transfer.consumers[:1], True),
                              Span(transfer.consumers[0] + 1, transfer.consumers[1:], True)])
    assert tfmem.validate(prefetched) is None


# --------------------------------------------------------------------------
# equivalence with plain Session.run


def _train(run, model, steps, stats=None):
    """Losses and final weights; `stats()` (if given) is recorded after every step."""
    losses, recorded = [], []
    for step in range(steps):
        _, loss = run([model.train, model.loss], feed_dict=model.data[step % len(model.data)])
        losses.append(loss)
        if stats is not None:
            recorded.append(stats())
    return np.array(losses), run(model.weights), recorded


@pytest.mark.parametrize("partition_size, mode, prefetch", [
    (3, mode, prefetch) for mode in MODES for prefetch in (0, 1, 3)
] + [(1, "all", 1), (6, "all", 3), (2, "auto", 2)])
def test_adam_training_matches_plain(partition_size, mode, prefetch, swap_pair):
    model = build_mlp("adam")
    plain, tfs = swap_pair(model.graph, partition_size, model.init, **_swap_kwargs(mode, prefetch))
    plan = tfs.plan([model.train, model.loss], feed_dict=model.data[0])
    check_plan(plan, model.graph, partition_size)
    _assert_swapping_as_asked(plan, mode)
    assert plan.policy.prefetch == prefetch

    # one graph, two sessions: plain steps first, then the same steps wrapped
    exp_losses, exp_w, _ = _train(plain.run, model, 4)
    got_losses, got_w, stats = _train(tfs.run, model, 4, lambda: tfs.last_step)
    np.testing.assert_allclose(got_losses, exp_losses, rtol=RTOL, atol=ATOL)
    assert_same_result(exp_w, got_w)
    assert not np.allclose(exp_losses[0], exp_losses[-1])  # training moved the weights
    swapped = sum(t.swapped for t in plan.transfers)
    assert all(s.swapped_out == swapped for s in stats), stats
    assert all(s.partitions == len(plan.partitions) for s in stats)


def _build_loop_model(seed=0):
    rs = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        w = tf1.Variable(rs.uniform(0.5, 1.0, 4).astype(np.float32), use_resource=True, name="w")
        pre = x
        for i in range(4):
            pre = tf.add(pre * 0.9, 0.1, name=f"pre{i}")

        def body(i, acc):
            return i + 1, tf.tanh(acc * w + pre)

        _, acc = tf.while_loop(lambda i, acc: i < 5, body, [tf.constant(0), pre])
        out = acc
        for i in range(4):
            out = tf.add(out * 0.9, pre, name=f"post{i}")
        loss = tf.reduce_sum(out * out, name="loss")
        grads = tf.gradients(loss, [w, x])
        train = tf1.train.AdamOptimizer(0.05).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    feed = {x: rs.standard_normal(4).astype(np.float32)}
    return g, w, loss, grads, train, init, feed


@pytest.mark.parametrize("partition_size, mode, prefetch", [
    (3, "all", 0), (2, "all", 1), (4, "all", 3), (3, "auto", 0), (2, "auto", 3), (3, "none", 1)])
def test_while_loop_matches_plain(control_flow, partition_size, mode, prefetch, swap_pair):
    g, w, loss, grads, train, init, feed = _build_loop_model()
    plain, tfs = swap_pair(g, partition_size, init, **_swap_kwargs(mode, prefetch))
    plan = tfs.plan(grads, feed_dict=feed)
    check_plan(plan, g, partition_size, strict_size=False)
    _assert_swapping_as_asked(plan, mode)
    assert_same_result(plain.run(grads, feed_dict=feed), tfs.run(grads, feed_dict=feed))
    exp = [plain.run([train, loss], feed_dict=feed)[1] for _ in range(3)]
    got = [tfs.run([train, loss], feed_dict=feed)[1] for _ in range(3)]
    _assert_swapping_as_asked(tfs.plan([train, loss], feed_dict=feed), mode)
    np.testing.assert_allclose(got, exp, rtol=RTOL, atol=ATOL)
    assert not np.allclose(exp[0], exp[-1])
    assert_same_result(plain.run(w), tfs.run(w))


def _build_mixed_dtypes():
    """Strings (of varying length) and ints crossing several partitions."""
    g = tf.Graph()
    with g.as_default():
        n = tf1.placeholder(tf.int32, [5], name="n")
        i1 = tf.multiply(n, 7, name="i1")
        words = tf.strings.as_string(i1, name="words")  # lengths vary with the values
        i2 = tf.add(i1, 3, name="i2")
        i3 = tf.square(i2, name="i3")
        tagged = tf.strings.join([words, tf.strings.as_string(i3)], separator=":", name="tagged")
        i4 = tf.bitwise.bitwise_xor(i3, i1, name="i4")
        big = tf.cast(i4, tf.int64, name="big") * 1000003
        length = tf.strings.length(tagged, name="length")
        joined = tf.strings.reduce_join(words, separator=",", name="joined")
        total = tf.add(tf.cast(length, tf.int64), big, name="total")
        flags = tf.greater(total, 50, name="flags")
        final = tf.where(flags, total, -total, name="final")
        fetches = [final, joined, tagged, i1]
    return g, n, fetches


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_strings_kept_ints_swapped(prefetch, swap_pair):
    g, n, fetches = _build_mixed_dtypes()
    plain, tfs = swap_pair(g, 1, swap="all", prefetch=prefetch)
    feeds = [{n: np.array([1, 22, 333, -4, 55555], np.int32)},
             {n: np.array([0, 9, -99999, 12, 3], np.int32)}]
    plan = tfs.plan(fetches, feed_dict=feeds[0])
    check_plan(plan, g, 1)
    by_dtype = {}
    for t in plan.transfers:
        by_dtype.setdefault(g.get_tensor_by_name(t.tensor).dtype, []).append(t)
    assert by_dtype.get(tf.string), "no string crosses a partition"
    assert by_dtype.get(tf.int32) and by_dtype.get(tf.int64), "no int crosses a partition"
    for t in by_dtype[tf.string]:
        assert t.kept and not t.swapped and len(t.spans) == 1, t
    for dtype in (tf.int32, tf.int64, tf.bool):
        for t in by_dtype.get(dtype, []):
            assert t.swapped and not t.kept, t
    for feed in feeds:
        assert_same_result(plain.run(fetches, feed_dict=feed), tfs.run(fetches, feed_dict=feed))
        assert tfs.last_step.swapped_out == sum(t.swapped for t in plan.transfers)


# --------------------------------------------------------------------------
# step stats


def _build_static(width=16):
    """Static shapes throughout; float, int and bool tensors; near and far readers."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4, width], name="x")
        w = tf1.Variable(np.linspace(-1, 1, width * width, dtype=np.float32).reshape(width, width),
                         name="w", use_resource=True)
        h0 = tf.tanh(tf.matmul(x, w), name="h0")
        idx = tf.argmax(h0, axis=1, output_type=tf.int32, name="idx")
        h1 = tf.sin(h0, name="h1")
        mask = tf.greater(h1, 0.0, name="mask")
        h2 = tf.cos(h1, name="h2")
        h3 = tf.exp(h2, name="h3")
        h4 = tf.where(mask, h3, h0, name="h4")
        h5 = tf.add(h4 * 0.5, tf.cast(idx * 3 + 1, tf.float32)[:, None], name="h5")
        out = tf.reduce_sum(h5 * h1, name="out")
        init = tf1.global_variables_initializer()
    feed = {x: np.random.RandomState(3).standard_normal((4, width)).astype(np.float32)}
    return g, out, init, feed


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_stats_count_what_the_plan_swaps(prefetch, swap_pair):
    g, out, init, feed = _build_static()
    plain, tfs = swap_pair(g, 2, init, swap="all", prefetch=prefetch)
    plan = tfs.plan(out, feed_dict=feed)
    swapped = [t for t in plan.transfers if t.swapped]
    assert len(swapped) >= 5
    assert {g.get_tensor_by_name(t.tensor).dtype for t in swapped} >= {tf.float32, tf.bool, tf.int32}
    uploaded = [(t, s) for t in plan.transfers for s in t.spans if s.uploaded]
    assert len(uploaded) > len(swapped)  # some tensors are uploaded more than once
    for step in range(3):
        assert_same_result(plain.run(out, feed_dict=feed), tfs.run(out, feed_dict=feed))
        stats = tfs.last_step
        assert isinstance(stats, tfmem.StepStats)
        assert stats.partitions == len(plan.partitions)
        assert stats.swapped_out == len(swapped)
        assert stats.swapped_out_bytes == sum(_nbytes(g, t.tensor) for t in swapped)
        assert stats.swapped_in == len(uploaded)
        assert stats.swapped_in_bytes == sum(_nbytes(g, t.tensor) for t, _ in uploaded)
        assert stats.wall_time > 0
        assert stats.prefetch_wait_time >= 0
        assert stats.prefetch_wait_time <= stats.wall_time
        assert stats.host_rss_bytes > 0
        # TensorFlow's figure where its allocator keeps one (an accelerator, an emulated
        # cap; see test_device_peak_is_tensorflows_figure_for_each_step), else None
        keeps_figures = accelerator.device_memory(accelerator.memory_device(tfs.session))
        assert (stats.device_peak_bytes is None) == (keeps_figures is None), stats
        assert stats.host_buffer_bytes == tfs.host_buffers.capacity_bytes > 0
        assert stats.peak_device_handles >= 1
        assert isinstance(str(stats), str)


def test_stats_without_swapping(swap_pair):
    """swap="none": nothing moves; handle peaks follow the plan's live transfers."""
    g, out, init, feed = _build_static()
    plain, tfs = swap_pair(g, 2, init, swap="none")
    plan = tfs.plan(out, feed_dict=feed)
    assert plan.transfers and not any(t.swapped for t in plan.transfers)
    assert_same_result(plain.run(out, feed_dict=feed), tfs.run(out, feed_dict=feed))
    stats = tfs.last_step
    assert stats.partitions == len(plan.partitions)
    assert (stats.swapped_out, stats.swapped_out_bytes, stats.swapped_in, stats.swapped_in_bytes) == (0, 0, 0, 0)
    assert stats.host_buffer_bytes == 0 and tfs.host_buffers.allocations == 0
    # a handle lives from its producer's call through its last reader's; within one
    # call (a stretch of partitions) a tensor is an edge, not a handle
    run = stretches.merged(plan)
    assert stats.calls == len(run.partitions)
    live = [[t for t in run.transfers if t.producer <= p <= max(t.consumers)]
            for p in range(len(run.partitions))]
    assert stats.peak_device_handles == max(len(ts) for ts in live)
    assert stats.peak_device_handle_bytes == max(sum(_nbytes(g, t.tensor) for t in ts) for ts in live)


def test_stats_auto_counts_only_far_gaps(swap_pair):
    g, out, init, feed = _build_static()
    plain, tfs = swap_pair(g, 1, init, swap="auto", swap_distance=2, prefetch=1,
                           options=tfmem.Options(swap_min_bytes=0))
    plan = tfs.plan(out, feed_dict=feed)
    far = [t for t in plan.transfers
           if any(b - a > 2 for a, b in zip((t.producer,) + t.consumers, t.consumers))]
    assert far and len(far) < len(plan.transfers)
    assert {t.tensor for t in plan.transfers if t.swapped} == {t.tensor for t in far}
    assert_same_result(plain.run(out, feed_dict=feed), tfs.run(out, feed_dict=feed))
    assert tfs.last_step.swapped_out == len(far)
    assert tfs.last_step.swapped_in == sum(s.uploaded for t in far for s in t.spans)


# --------------------------------------------------------------------------
# the device peak under an emulated cap (a subprocess: the cap is set before TF starts)

PEAK_ROWS = (4096, 16, 4096, 16)  # a [4096, 256] float32 tensor is 4 MiB; [16, 256] 16 KiB
PEAK_WIDTH = 256


def _peak_worker():
    """Subprocess entry: steps of alternating size; print what tfmem and TensorFlow report."""
    assert accelerator.emulated_memory_mib() is not None
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, PEAK_WIDTH], name="x")
        w = tf1.Variable(np.eye(PEAK_WIDTH, dtype=np.float32) * 0.5, name="w", use_resource=True)
        h = tf.tanh(tf.matmul(x, w))
        for i in range(4):
            h = tf.sin(h) + h if i % 2 else tf.tanh(h)
        out = tf.reduce_sum(h)
        init = tf1.global_variables_initializer()
    tfs = tfmem.TFMemSession(new_session(g), partition_size=2, swap="all",
                             # the device peak of every step
                             options=tfmem.Options(swap_min_bytes=0, measure="every"))
    tfs.run(init)
    steps = []
    for rows in PEAK_ROWS:
        tfs.run(out, feed_dict={x: np.ones((rows, PEAK_WIDTH), np.float32)})
        steps.append(dict(rows=rows, reported=tfs.last_step.device_peak_bytes,
                          tensorflow=int(accelerator.device_memory("CPU:0")["peak"])))
    tfs.close()
    print("TFMEM-RESULTS " + json.dumps(steps))


def test_device_peak_is_tensorflows_figure_for_each_step():
    """Each step reports its own peak, not an earlier, larger step's, and leaves
    TensorFlow's process-wide peak figure alone."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB="512",
               TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_swap; test_swap._peak_worker()"
    steps = run_worker(code, env, timeout=300)
    big = PEAK_ROWS[0] * PEAK_WIDTH * 4
    for before, step in zip([None] + steps, steps):
        assert isinstance(step["reported"], int), step
        # a figure of this step, within TensorFlow's process-wide peak ...
        assert 0 < step["reported"] <= step["tensorflow"], step
        if step["rows"] == PEAK_ROWS[0]:
            assert step["reported"] >= big, step  # the [4096, 256] activation was on the device
        else:
            assert step["reported"] < big, step  # a peak carried over from the larger step
        # ... which belongs to the user: tfmem never resets it
        if before is not None:
            assert step["tensorflow"] >= max(before["tensorflow"], before["reported"]), steps
