"""tfmem on TensorFlow's distributed runtime: a cluster of one ps and one worker.

The servers are TensorFlow's own, each in a subprocess on 127.0.0.1 (see
experiments/local_cluster.py), killed at teardown whatever happens, and each
with a lifetime of its own.  The test process is the client: its sessions
talk to the worker's master, variables live on the ps
(replica_device_setter).  Expected values come from a plain session on the
same cluster.
"""

import sys
import contextlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.plan import updates

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

from local_cluster import LocalCluster  # noqa: E402  pylint: disable=wrong-import-position

tf1 = tf.compat.v1
WORKER = "/job:worker/task:0"
STEP_DEADLINE_MS = 30_000


def _local_cluster():
    return LocalCluster({"ps": 1, "worker": 1}, lifetime=240,
                        env={"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2",
                             "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the tests that leave it intact (each uses its own variables)."""
    with _local_cluster() as local:
        local.start_servers()
        yield local


@pytest.fixture
def fresh_cluster():
    """A cluster of its own, for a test that kills a task."""
    with _local_cluster() as local:
        local.start_servers()
        yield local


def _session(target, graph):
    # operation_timeout_in_ms is the only deadline of a GrpcSession's calls.
    return tf1.Session(target, graph=graph, config=tf1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=2,
        operation_timeout_in_ms=STEP_DEADLINE_MS))


def _mlp(spec, scope, depth=4, width=48, batch=32):
    """A small MLP training step with its variables on the ps; returns the graph and ops."""
    graph = tf.Graph()
    rng = np.random.RandomState(0)
    placement = (tf1.train.replica_device_setter(worker_device=WORKER, cluster=spec)
                 if spec else None)  # no spec: a local graph
    with graph.as_default(), graph.device(placement):
        with tf1.variable_scope(scope):
            x = tf1.placeholder(tf.float32, [batch, width], name="x")
            h = x
            for i in range(depth):
                w = tf1.get_variable(f"w{i}", initializer=(rng.randn(width, width) * 0.3)
                                     .astype(np.float32), use_resource=True)
                h = tf.tanh(h @ w)
            loss = tf.reduce_mean(tf.square(h - 0.5))
            step = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
            init = tf1.global_variables_initializer()
            weights = tf1.global_variables()
    return graph, x, loss, step, init, weights


def _batches(steps, batch=32, width=48):
    rng = np.random.RandomState(1)
    return [rng.randn(batch, width).astype(np.float32) for _ in range(steps)]


def test_partitioned_steps_equal_a_plain_distributed_session(cluster):
    target = cluster.target("worker", 0)
    data = _batches(3)
    options = tf1.RunOptions(timeout_in_ms=STEP_DEADLINE_MS)

    graph, x, loss, step, init, weights = _mlp(cluster.spec, "plain")
    plain = _session(target, graph)
    plain.run(init)
    expected = []
    for batch in data:
        expected.append(plain.run([step, loss], {x: batch}, options=options)[1])
        expected.append(plain.run(weights))

    graph, x, loss, step, init, weights = _mlp(cluster.spec, "tfmem")
    sess = _session(target, graph)
    sess.run(init)
    # Small partitions, every cross-partition tensor swapped or staged on the worker.
    tfs = tfmem.TFMemSession(sess, partition_size=6, swap="all", swap_min_bytes=0,
                             swap_distance=1)
    got = []
    for batch in data:
        got.append(tfs.run([step, loss], {x: batch}, options=options)[1])
        got.append(sess.run(weights))
        assert tfs.last_step.partitions > 4
        assert tfs.last_step.swapped_in > 0  # uploads staged on the worker, read back
        assert tfs.last_step.peak_device_handles > 0
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    # The step's updates run in one partition, the last one (atomic_updates on by default).
    plan = tfs.plan([step, loss], {x: data[0]})
    assert updates.update_partitions(plan) == (len(plan.partitions) - 1,)
    # Device figures of a worker in another process are not this process's: not reported.
    assert tfs.last_step.device_peak_bytes is None
    tfs.close()
    plain.close()


def test_atomic_updates_on_a_local_session_equal_plain(sessions):
    """The same gathering on a local session: one update partition, the plain results."""
    data = _batches(2)
    results = []
    for atomic in (None, True):
        graph, x, loss, step, init, weights = _mlp(None, "local")
        sess = sessions(graph)
        sess.run(init)
        runner = sess if atomic is None else tfmem.TFMemSession(
            sess, partition_size=5, swap="all", swap_min_bytes=0, atomic_updates=True)
        results.append([runner.run([step, loss], {x: batch})[1] for batch in data]
                       + sess.run(weights))
        if atomic:
            plan = runner.plan([step, loss], {x: data[0]})
            assert updates.update_partitions(plan) == (len(plan.partitions) - 1,)
            assert len(plan.partitions) > 3
    for want, have in zip(*results):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def test_auto_partition_size_needs_a_budget_for_a_remote_worker(cluster):
    graph, *_ = _mlp(cluster.spec, "auto")
    sess = _session(cluster.target("worker", 0), graph)
    with pytest.raises(tfmem.TFMemError, match="device_memory_budget"):
        tfmem.TFMemSession(sess, partition_size="auto")
    sess.close()


def _gated_step(spec):
    """Two independent updates; w2's gradient waits on a queue the test never fills.

    Without atomic updates the depth-first order applies w1's update (a short
    chain) in an early partition, and the step then blocks on the dequeue.
    """
    graph = tf.Graph()
    with graph.as_default(), graph.device(
            tf1.train.replica_device_setter(worker_device=WORKER, cluster=spec)):
        w1 = tf1.get_variable("w1", initializer=np.ones((8, 8), np.float32), use_resource=True)
        w2 = tf1.get_variable("w2", initializer=np.ones((8, 8), np.float32), use_resource=True)
        gate = tf1.FIFOQueue(4, tf.float32, shapes=[[8, 8]], shared_name="gate")
        x = tf1.placeholder(tf.float32, [8, 8], name="x")
        loss1 = tf.reduce_sum(tf.square(x @ w1))
        h = gate.dequeue()
        for _ in range(6):
            h = tf.tanh(h @ w2)
        loss2 = tf.reduce_sum(tf.square(h))
        opt = tf1.train.GradientDescentOptimizer(0.01)
        step = tf.group(opt.apply_gradients([(tf.gradients(loss1, w1)[0], w1)]),
                        opt.apply_gradients([(tf.gradients(loss2, w2)[0], w2)]))
        init = tf1.global_variables_initializer()
    return graph, x, step, init


def _ps_values(cluster):
    """w1, w2 as the ps holds them, read through the ps's own master."""
    graph = tf.Graph()
    with graph.as_default(), graph.device("/job:ps/task:0"):
        values = [tf1.get_variable(name, shape=(8, 8), use_resource=True).read_value()
                  for name in ("w1", "w2")]
    with tf1.Session(cluster.target("ps", 0), graph=graph,
                     config=tf1.ConfigProto(device_filters=["/job:ps"])) as sess:
        return sess.run(values, options=tf1.RunOptions(timeout_in_ms=STEP_DEADLINE_MS))


def test_a_worker_dying_mid_step_leaves_no_half_applied_update(fresh_cluster):
    cluster = fresh_cluster
    graph, x, step, init = _gated_step(cluster.spec)
    sess = _session(cluster.target("worker", 0), graph)
    sess.run(init)
    tfs = tfmem.TFMemSession(sess, partition_size=3, swap="none")
    batch = np.ones((8, 8), np.float32)
    plan = tfs.plan(step, {x: batch})
    gate = next(p.index for p in plan.partitions
                if any(plan.view.nodes[n].type.startswith("QueueDequeue") for n in p.ops))
    assert updates.update_partitions(plan) == (len(plan.partitions) - 1,)
    assert gate < len(plan.partitions) - 1  # the step blocks before its updates
    before = _ps_values(cluster)

    outcome = {}

    def run_step():
        try:
            tfs.run(step, {x: batch})
        except Exception as err:  # pylint: disable=broad-except
            outcome["error"] = err

    runner = threading.Thread(target=run_step)
    runner.start()
    time.sleep(3)  # the step is blocked on the empty queue, in partition `gate`
    cluster.kill("worker", 0)
    runner.join(timeout=2 * STEP_DEADLINE_MS / 1000)
    assert not runner.is_alive()
    # Close before tfmem's callables are collected: a callable of an open session releases
    # itself by an RPC to the (now dead) master, which blocked a later test's garbage
    # collection for minutes. TFMemSession.close closes the session first, so its
    # callables skip that RPC. Closing itself asks the dead master and fails at the deadline.
    with contextlib.suppress(tf.errors.OpError):
        tfs.close()

    error = outcome.get("error")
    assert isinstance(error, tfmem.RemoteTaskError), repr(error)
    assert "/job:worker/replica:0/task:0" in str(error)
    assert error.partition == gate
    assert not error.updates_applied
    after = _ps_values(cluster)
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new, old)
