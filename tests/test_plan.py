"""Plans: invariants for every partition_size, planning without running,
the plan cache, growing graphs and determinism."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import assert_same_result, build_chain, build_mlp, check_plan, plan_ops

tf1 = tf.compat.v1

CHAIN_OPS = ["h", "out"] + [f"c{i}" for i in range(10)]


def _ancestors(fetch_ops, fed_names=()):
    """Names of the ops Session.run would need for fetch_ops (walk stops at fed tensors)."""
    seen, stack = set(), list(fetch_ops)
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(t.op for t in op.inputs if t.name not in fed_names)
        stack.extend(op.control_inputs)
    return seen


@pytest.mark.parametrize("partition_size", list(range(1, 22)) + [1000])
def test_every_partition_size(partition_size, pair):
    m = build_chain()
    plain, tfs = pair(m.graph, partition_size, m.init)
    fetches = [m.out, m.t]
    plan = tfs.plan(fetches, feed_dict=m.feed)
    assert plan.partition_size == partition_size
    where = check_plan(plan, m.graph, partition_size)
    n_ops = len(where)
    assert n_ops >= len(CHAIN_OPS)
    # greedy slicing: fewest partitions possible for the size, one if it all fits
    assert len(plan.partitions) >= -(-n_ops // partition_size)
    if partition_size >= n_ops:
        assert len(plan.partitions) == 1
    if partition_size <= 3:
        assert len(plan.partitions) > 1
    # public fields are consistent with the transfers
    for t in plan.transfers:
        assert t.tensor in plan.partitions[t.producer].outputs
        for c in t.consumers:
            assert t.tensor in plan.partitions[c].inputs
    for p in plan.partitions:
        for name in p.inputs:
            assert any(t.tensor == name and p.index in t.consumers for t in plan.transfers)
        for name in p.outputs:
            assert any(t.tensor == name and t.producer == p.index for t in plan.transfers)
    fetched = [f for p in plan.partitions for f in p.fetches]
    for f in ("out:0", m.t.name):
        assert fetched.count(f) == 1
    assert_same_result(plain.run(fetches, feed_dict=m.feed), tfs.run(fetches, feed_dict=m.feed))


def test_plan_holds_exactly_the_needed_ops(pair):
    m = build_chain()
    _, tfs = pair(m.graph, 4)
    plan = tfs.plan(m.out, feed_dict=m.feed)
    ops = set(plan_ops(plan))
    assert set(CHAIN_OPS) <= ops
    assert ops <= _ancestors([m.out.op], {m.x.name})
    assert "unrelated" not in ops and "u_c" not in ops
    assert m.x.op.name not in ops  # fed: Session.run does not run it
    # a feed cuts the walk: nothing upstream of h
    plan_h = tfs.plan(m.out, feed_dict={m.h: np.zeros((2, 3), np.float32)})
    ops_h = set(plan_ops(plan_h))
    assert "h" not in ops_h and "c0" in ops_h
    assert ops_h <= _ancestors([m.out.op], {m.h.name})


def test_plan_does_not_run_anything(pair):
    g = tf.Graph()
    with g.as_default():
        v = tf1.Variable(0.0, use_resource=True, name="v")
        inc = v.assign_add(1.0)
        out = inc
        for _ in range(4):
            out = out * 2.0
        it = tf1.data.make_one_shot_iterator(tf.data.Dataset.range(5))
        nxt = it.get_next()
        init = tf1.global_variables_initializer()
    plain, tfs = pair(g, 2, init)
    plan = tfs.plan([out, nxt])
    assert len(plan.partitions) > 1
    tfs.plan(inc)
    assert isinstance(plan, tfmem.Plan)
    assert tfs.run(v) == 0.0
    assert tfs.session.run(v) == 0.0
    assert tfs.run(nxt) == 0
    assert plain.run(nxt) == 0  # keep the plain iterator in step
    # running the planned request runs the assign once and advances once
    assert_same_result(plain.run([out, nxt]), tfs.run([out, nxt]))
    assert tfs.run(nxt) == 2
    assert_same_result(plain.run(v), tfs.run(v))


def test_plan_is_frozen_and_printable(pair):
    m = build_chain()
    _, tfs = pair(m.graph, 3)
    plan = tfs.plan(m.out, feed_dict=m.feed)
    with pytest.raises(AttributeError):
        plan.partition_size = 7
    with pytest.raises(AttributeError):
        plan.partitions[0].ops = ()
    assert isinstance(plan.partitions, tuple) and isinstance(plan.transfers, tuple)
    assert isinstance(plan.partitions[0].ops, tuple)
    assert isinstance(str(plan), str) and isinstance(repr(plan), str)


def _broken_plans(plan):
    """Copies of ``plan`` that each break one invariant ``validate`` checks."""
    parts = plan.partitions
    first, last = parts[0], parts[-1]
    broken = {}
    # an op in two partitions
    broken["duplicate_op"] = dataclasses.replace(
        plan, partitions=parts[:-1] + (dataclasses.replace(last, ops=last.ops + (first.ops[0],)),))
    # an op in no partition
    broken["missing_op"] = dataclasses.replace(
        plan, partitions=(dataclasses.replace(first, ops=first.ops[1:]),) + parts[1:])
    # consumers before producers
    swapped = [dataclasses.replace(p, ops=q.ops) for p, q in zip(parts, reversed(parts))]
    broken["reversed"] = dataclasses.replace(plan, partitions=tuple(swapped))
    # a boundary tensor without a transfer
    broken["no_transfers"] = dataclasses.replace(plan, transfers=())
    # a transfer that names the wrong producer
    t = plan.transfers[0]
    wrong = dataclasses.replace(t, producer=t.consumers[0])
    broken["wrong_producer"] = dataclasses.replace(plan, transfers=(wrong,) + plan.transfers[1:])
    # a partition larger than partition_size
    merged = dataclasses.replace(first, ops=tuple(o for p in parts for o in p.ops))
    broken["oversized"] = dataclasses.replace(plan, partitions=(merged,))
    return broken


@pytest.mark.parametrize("kind", ["duplicate_op", "missing_op", "reversed", "no_transfers", "wrong_producer", "oversized"])
def test_validate_rejects_broken_plans(kind, pair):
    m = build_chain()
    _, tfs = pair(m.graph, 3)
    plan = tfs.plan(m.out, feed_dict=m.feed)
    assert len(plan.partitions) > 2 and plan.transfers
    assert tfmem.validate(plan) is None
    if not dataclasses.is_dataclass(plan):
        pytest.skip("plans are not dataclasses; cannot derive broken copies")
    bad = _broken_plans(plan)[kind]
    with pytest.raises(tfmem.InvalidPlanError):
        tfmem.validate(bad)
    assert issubclass(tfmem.InvalidPlanError, tfmem.TFMemError)


def test_plan_cache_returns_identical_plan(pair):
    m = build_chain()
    _, tfs = pair(m.graph, 3, m.init)
    p1 = tfs.plan([m.out, m.h], feed_dict=m.feed)
    assert tfs.plan([m.out, m.h], feed_dict=m.feed) is p1
    # the signature is the request, not the fed values
    other = {m.x: np.ones((2, 3), np.float32)}
    assert tfs.plan([m.out, m.h], feed_dict=other) is p1
    # running the request does not replace the cached plan
    tfs.run([m.out, m.h], feed_dict=m.feed)
    assert tfs.plan([m.out, m.h], feed_dict=m.feed) is p1
    # a different request gets a different plan
    p2 = tfs.plan(m.out, feed_dict={m.h: np.zeros((2, 3), np.float32)})
    assert p2 is not p1
    assert set(plan_ops(p2)) != set(plan_ops(p1))


def test_graph_grown_after_run(pair):
    m = build_chain()
    plain, tfs = pair(m.graph, 3, m.init)
    assert_same_result(plain.run(m.out, feed_dict=m.feed), tfs.run(m.out, feed_dict=m.feed))
    with m.graph.as_default():
        z = m.out * 3.0
        for _ in range(4):
            z = tf.sqrt(tf.abs(z) + 1.0)
        w2 = tf1.Variable(np.float32(0.5), use_resource=True, name="w2")
        z = z * w2
        init2 = tf1.variables_initializer([w2])
    plain.run(init2)
    tfs.run(init2)
    plan = tfs.plan([z, m.out], feed_dict=m.feed)
    assert len(plan.partitions) > 1
    check_plan(plan, m.graph, 3)
    assert_same_result(plain.run([z, m.out], feed_dict=m.feed), tfs.run([z, m.out], feed_dict=m.feed))
    # the old request still works too
    assert_same_result(plain.run(m.out, feed_dict=m.feed), tfs.run(m.out, feed_dict=m.feed))


def _partition_signature(plan):
    return (
        [list(p.ops) for p in plan.partitions],
        sorted((t.tensor, t.producer, list(t.consumers)) for t in plan.transfers),
    )


@pytest.mark.parametrize("partition_size", [2, 7])
def test_identical_graphs_give_identical_partitions(partition_size, sessions):
    a, b = build_mlp("adam"), build_mlp("adam")
    tfs_a = tfmem.TFMemSession(sessions(a.graph), partition_size=partition_size)
    tfs_b = tfmem.TFMemSession(sessions(b.graph), partition_size=partition_size)
    plan_a = tfs_a.plan([a.train, a.loss], feed_dict=a.data[0])
    plan_b = tfs_b.plan([b.train, b.loss], feed_dict=b.data[0])
    assert len(plan_a.partitions) > 1
    assert _partition_signature(plan_a) == _partition_signature(plan_b)


_SUBPROCESS_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import conftest, tfmem
    m = conftest.build_mlp("adam")
    sess = conftest.new_session(m.graph)
    tfs = tfmem.TFMemSession(sess, partition_size=5)
    plan = tfs.plan([m.train, m.loss], feed_dict=m.data[0])
    print(json.dumps([[list(p.ops) for p in plan.partitions],
                      sorted([t.tensor, t.producer, list(t.consumers)] for t in plan.transfers)]))
    """
)


@pytest.mark.slow
def test_partitions_do_not_depend_on_hash_seed():
    """Planning is a pure function of the graph: no set/dict-order dependence."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    script = _SUBPROCESS_SCRIPT.format(tests=tests_dir)
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(tests_dir), env.get("PYTHONPATH")]))
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len(outputs[0][0]) > 1
    assert outputs[0] == outputs[1]
