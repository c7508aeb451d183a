"""tfmem on TensorFlow's distributed runtime: a cluster of one ps and one worker.

The servers are TensorFlow's own, each in a subprocess on 127.0.0.1 (see
experiments/local_cluster.py), killed at teardown whatever happens, and each
with a lifetime of its own.  They listen on every interface (TensorFlow
hard-codes 0.0.0.0), so each cluster test runs in a private network
namespace with only loopback: a fresh client process enters it, starts the
cluster there and runs one `check_*` function (its sessions talk to the
worker's master, variables live on the ps through replica_device_setter);
the test passes when that check does, and shows its output when it does
not.  Where no such namespace can be made, the cluster tests skip, naming
what is missing.  Expected values come from a plain session on the same
cluster.
"""

import os
import socket
import sys
import contextlib
import traceback
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.plan import updates

from experiments import local_cluster
from experiments.local_cluster import LocalCluster

tf1 = tf.compat.v1
WORKER = "/job:worker/task:0"
STEP_DEADLINE_MS = 30_000
CLUSTER_LIFETIME = 240  # seconds a server may live
CHECK_TIMEOUT = 300  # seconds a check's process group may live, servers included


def _local_cluster():
    return LocalCluster({"ps": 1, "worker": 1}, lifetime=CLUSTER_LIFETIME,
                        env={"TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "2",
                             "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})


@pytest.fixture(scope="module")
def private_network():
    """Skips the cluster tests where no private network namespace can be made."""
    problem = local_cluster.private_network_problem()
    if problem:
        pytest.skip("the test cluster needs a private network namespace (TensorFlow's servers "
                    f"listen on every interface), and none can be made here: {problem}")


PASSED = "TFMEM-CHECK-PASSED"


def _in_private_network(*checks):
    """Run each `check(cluster)` in one fresh client process inside a private network
    namespace, on a cluster of its own; return {check name: None if it passed, else
    the process's output}."""
    names = [check.__name__ for check in checks]
    # the child imports this module from the tests' folder, on the PYTHONPATH below
    code = f"import test_distributed; test_distributed.run_checks({names!r})"
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(sys.path))
    status, output = local_cluster.run_private([sys.executable, "-c", code], CHECK_TIMEOUT, env)
    passed = {line.split()[1] for line in output.splitlines() if line.startswith(PASSED)}
    failure = f"failed in its private network (exit code {status}):\n{output[-8000:]}"
    return {name: None if name in passed else failure for name in names}


def _passes(outcomes, check):
    if outcomes[check.__name__] is not None:
        pytest.fail(f"{check.__name__} {outcomes[check.__name__]}", pytrace=False)


def run_checks(names):
    """The client process of `_in_private_network`: start the cluster, run the checks."""
    status = 0
    local_cluster.exit_when_orphaned_or_after(CHECK_TIMEOUT)  # pytest killed: end too
    try:
        assert local_cluster.in_private_network(), socket.if_nameindex()
        with _local_cluster() as cluster:
            cluster.start_servers()
            for name in names:
                try:
                    globals()[name](cluster)
                    print(PASSED, name, flush=True)
                except Exception:  # pylint: disable=broad-except
                    traceback.print_exc()
                    status = 1
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access  # no teardown of gRPC channels


@pytest.fixture(scope="module")
def shared_cluster(private_network):  # pylint: disable=unused-argument,redefined-outer-name
    """The checks that leave their cluster intact share one (each has its own variables)."""
    return _in_private_network(check_partitioned_steps_equal_a_plain_distributed_session,
                               check_auto_partition_size_needs_a_budget_for_a_remote_worker,
                               check_concurrent_steps_of_one_plan_equal_plain,
                               check_steps_of_one_plan_overlap_while_one_waits,
                               check_a_failing_step_removes_only_its_own_staged_tensors)


def test_the_cluster_refuses_to_start_outside_a_private_network():
    if local_cluster.in_private_network():
        pytest.skip("this test process already runs in a private network namespace")
    cluster = _local_cluster()
    with pytest.raises(local_cluster.NoPrivateNetwork, match="allow_all_interfaces"):
        cluster.start_servers()
    assert not cluster._procs  # pylint: disable=protected-access  # nothing was started


@pytest.mark.slow
def test_partitioned_steps_equal_a_plain_distributed_session(shared_cluster):  # pylint: disable=redefined-outer-name
    _passes(shared_cluster, check_partitioned_steps_equal_a_plain_distributed_session)


@pytest.mark.slow
def test_auto_partition_size_needs_a_budget_for_a_remote_worker(shared_cluster):  # pylint: disable=redefined-outer-name
    _passes(shared_cluster, check_auto_partition_size_needs_a_budget_for_a_remote_worker)


@pytest.mark.slow
def test_a_worker_dying_mid_step_leaves_no_half_applied_update(private_network):  # pylint: disable=unused-argument,redefined-outer-name
    """On a cluster of its own: the check kills the worker."""
    check = check_a_worker_dying_mid_step_leaves_no_half_applied_update
    _passes(_in_private_network(check), check)


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


def check_partitioned_steps_equal_a_plain_distributed_session(cluster):
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
    tfs = tfmem.TFMemSession(sess, partition_size=6, swap="all", swap_distance=1,
                             options=tfmem.Options(swap_min_bytes=0))
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


def _run_to_the_end(threads):
    """Start `threads` and wait for them all, each within a few step deadlines."""
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * STEP_DEADLINE_MS / 1000)
    assert not any(thread.is_alive() for thread in threads)


def check_concurrent_steps_of_one_plan_equal_plain(cluster):
    """Three threads run one plan at once; each step's values are plain TensorFlow's.

    On a distributed session each step stages at keys of its own (see
    residence.PlanStaging); with keys fixed per plan and no lock, two steps would stage
    at one key and read each other's tensors (the three threads end in DeadlineExceeded).
    """
    graph, x, loss, _, init, weights = _mlp(cluster.spec, "concurrent")
    with graph.as_default(), graph.device(WORKER):
        grads = tf.gradients(loss, weights)
    sess = _session(cluster.target("worker", 0), graph)
    sess.run(init)
    data = _batches(6)
    expected = [sess.run([loss, grads], {x: batch}) for batch in data]
    tfs = tfmem.TFMemSession(sess, partition_size=6, swap="all", swap_distance=1,
                             options=tfmem.Options(swap_min_bytes=0))
    tfs.run([loss, grads], {x: data[0]})  # the plan, built before the threads share it
    assert tfs.last_step.peak_device_handles > 0 and tfs.last_step.swapped_in > 0
    got, errors = [None] * len(data), []

    def work(first):
        try:
            for i in range(first, len(data), 3):
                got[i] = tfs.run([loss, grads], {x: data[i]})
        except Exception as err:  # pylint: disable=broad-except
            errors.append(err)

    threads = [threading.Thread(target=work, args=(first,)) for first in range(3)]
    _run_to_the_end(threads)
    assert not errors, errors
    for want, have in zip(expected, got):
        np.testing.assert_allclose(have[0], want[0], rtol=1e-5, atol=1e-6)
        for want_grad, have_grad in zip(want[1], have[1]):
            np.testing.assert_allclose(have_grad, want_grad, rtol=1e-5, atol=1e-6)
    tfs.close()


@pytest.mark.slow
def test_concurrent_steps_of_one_plan_equal_plain(shared_cluster):  # pylint: disable=redefined-outer-name
    _passes(shared_cluster, check_concurrent_steps_of_one_plan_equal_plain)


def _staged_counter(sess):
    """A function returning how many tensors every staging area of the session's graph
    holds now (MapSize beside each area's MapStage ops); made before steps overlap."""
    graph = sess.graph
    sizes = {}
    with graph.as_default():
        for op in graph.get_operations():
            if op.type == "MapStage":
                area = (op.get_attr("shared_name"), tuple(op.get_attr("dtypes")),
                        tuple(op.colocation_groups()))
                if area not in sizes:
                    with graph.colocate_with(op), tf.control_dependencies(None):
                        sizes[area] = tf.raw_ops.MapSize(dtypes=list(area[1]),
                                                         shared_name=area[0])
        assert sizes, "the plan stages nothing: the check would prove nothing"
        total = tf.add_n(list(sizes.values()))
    return lambda: int(sess.run(total, options=tf1.RunOptions(timeout_in_ms=STEP_DEADLINE_MS)))


def _wait_for(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.2)


def _gated_forward(spec, scope):
    """An MLP whose middle waits on a queue item (the same value for every step), with
    its gradients: a step blocks there with its forward activations staged."""
    graph, x, loss, _, init, weights = _mlp(spec, scope, depth=2)
    with graph.as_default(), graph.device(WORKER), tf1.variable_scope(scope + "_gated"):
        gate = tf1.FIFOQueue(8, tf.float32, shapes=[[48, 48]], shared_name=scope + "_gate")
        h = tf.tanh(loss + x)
        with tf.control_dependencies([h]):  # dequeued after the first layers ran
            item = gate.dequeue()
        for i in range(2):
            h = tf.tanh(h @ (item + float(i)))
        gated_loss = tf.reduce_mean(tf.square(h))
        grads = tf.gradients(gated_loss, weights)
        fill = gate.enqueue(tf.fill([48, 48], 0.01))
    return graph, x, gated_loss, grads, init, fill


def check_steps_of_one_plan_overlap_while_one_waits(cluster):
    """A step waiting in a late partition does not hold up another step of its plan.

    Step A blocks on an empty queue, its early partitions' tensors staged on the
    worker; step B of the same plan starts and blocks there too, with its own
    tensors staged beside A's (a per-plan lock held B back: the staged count stayed
    at A's).  Two queue items later both finish, each with plain TensorFlow's values.
    """
    graph, x, loss, grads, init, fill = _gated_forward(cluster.spec, "overlap")
    sess = _session(cluster.target("worker", 0), graph)
    sess.run(init)
    data = _batches(3)
    sess.run(fill)
    expected = sess.run([loss, grads], {x: data[0]})
    tfs = tfmem.TFMemSession(sess, partition_size=6, swap="all", swap_distance=1,
                             options=tfmem.Options(swap_min_bytes=0))
    sess.run(fill)
    tfs.run([loss, grads], {x: data[0]})  # plan and compile before the threads
    staged = _staged_counter(sess)
    assert staged() == 0
    got, errors = {}, []

    def work(name):
        try:
            got[name] = tfs.run([loss, grads], {x: data[0]})
        except Exception as err:  # pylint: disable=broad-except
            errors.append(err)

    first = threading.Thread(target=work, args=("first",))
    first.start()
    _wait_for(lambda: staged() > 0, 60, "the first step to stage its tensors and wait")
    time.sleep(1)
    one_step = staged()
    second = threading.Thread(target=work, args=("second",))
    second.start()
    _wait_for(lambda: staged() >= 2 * one_step, 30,
              f"the second step to stage beside the first ({one_step} tensors each)")
    sess.run(fill)
    sess.run(fill)
    for thread in (first, second):
        thread.join(timeout=2 * STEP_DEADLINE_MS / 1000)
    assert not first.is_alive() and not second.is_alive()
    assert not errors, errors
    for name in ("first", "second"):
        np.testing.assert_allclose(got[name][0], expected[0], rtol=1e-5, atol=1e-6)
        for want, have in zip(expected[1], got[name][1]):
            np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    assert staged() == 0
    tfs.close()


def _mlp_with_check(spec, scope):
    """An MLP whose middle multiplies by a fed scale and checks it is finite: a NaN
    scale fails the step in a middle partition, after forward tensors were staged."""
    graph, x, _, _, init, weights = _mlp(spec, scope, depth=1)
    with graph.as_default(), graph.device(WORKER), tf1.variable_scope(scope + "_checked"):
        scale = tf1.placeholder(tf.float32, [], name="scale")
        h = tf.tanh(x @ weights[0])
        h = tf.debugging.check_numerics(h * scale, "the fed scale")
        for i in range(3):
            h = tf.tanh(h @ (weights[0] * float(i + 1)))
        loss = tf.reduce_mean(tf.square(h - 0.5))
        grads = tf.gradients(loss, weights)
    return graph, x, scale, loss, grads, init


def check_a_failing_step_removes_only_its_own_staged_tensors(cluster):
    """Steps failing mid-way beside good steps of the same plan: each failure raises
    TensorFlow's error and removes its own staged tensors; the good steps keep theirs
    and return plain TensorFlow's values; after many steps no area holds a tensor."""
    graph, x, scale, loss, grads, init = _mlp_with_check(cluster.spec, "failing")
    sess = _session(cluster.target("worker", 0), graph)
    sess.run(init)
    data = _batches(12)
    expected = [sess.run([loss, grads], {x: batch, scale: 1.0}) for batch in data]
    tfs = tfmem.TFMemSession(sess, partition_size=5, swap="all", swap_distance=1,
                             options=tfmem.Options(swap_min_bytes=0))
    tfs.run([loss, grads], {x: data[0], scale: 1.0})
    assert tfs.last_step.partitions > 4 and tfs.last_step.peak_device_handles > 0
    staged = _staged_counter(sess)
    with pytest.raises(tf.errors.InvalidArgumentError, match="the fed scale"):
        tfs.run([loss, grads], {x: data[0], scale: np.nan})
    assert staged() == 0  # alone: the failed step left nothing
    got, errors, failures = {}, [], []

    def good():
        try:
            for i, batch in enumerate(data):
                got[i] = tfs.run([loss, grads], {x: batch, scale: 1.0})
        except Exception as err:  # pylint: disable=broad-except
            errors.append(err)

    def bad():
        for batch in data:
            try:
                tfs.run([loss, grads], {x: batch, scale: np.nan})
            except tf.errors.InvalidArgumentError as err:
                failures.append(err)
            except Exception as err:  # pylint: disable=broad-except
                errors.append(err)

    threads = [threading.Thread(target=good), threading.Thread(target=bad)]
    _run_to_the_end(threads)
    assert not errors, errors
    assert len(failures) == len(data)
    for i, want in enumerate(expected):
        np.testing.assert_allclose(got[i][0], want[0], rtol=1e-5, atol=1e-6)
        for want_grad, have_grad in zip(want[1], got[i][1]):
            np.testing.assert_allclose(have_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert staged() == 0  # nothing staged is left after 12 good and 13 failed steps
    tfs.close()


@pytest.mark.slow
def test_steps_of_one_plan_overlap_while_one_waits(shared_cluster):  # pylint: disable=redefined-outer-name
    _passes(shared_cluster, check_steps_of_one_plan_overlap_while_one_waits)


@pytest.mark.slow
def test_a_failing_step_removes_only_its_own_staged_tensors(shared_cluster):  # pylint: disable=redefined-outer-name
    _passes(shared_cluster, check_a_failing_step_removes_only_its_own_staged_tensors)


def test_atomic_updates_on_a_local_session_equal_plain(sessions):
    """The same gathering on a local session: one update partition, the plain results."""
    data = _batches(2)
    results = []
    for atomic in (None, True):
        graph, x, loss, step, init, weights = _mlp(None, "local")
        sess = sessions(graph)
        sess.run(init)
        runner = sess if atomic is None else tfmem.TFMemSession(
            sess, partition_size=5, swap="all",
            options=tfmem.Options(swap_min_bytes=0, atomic_updates=True))
        results.append([runner.run([step, loss], {x: batch})[1] for batch in data]
                       + sess.run(weights))
        if atomic:
            plan = runner.plan([step, loss], {x: data[0]})
            assert updates.update_partitions(plan) == (len(plan.partitions) - 1,)
            assert len(plan.partitions) > 3
    for want, have in zip(*results):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


def check_auto_partition_size_needs_a_budget_for_a_remote_worker(cluster):
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


def check_a_worker_dying_mid_step_leaves_no_half_applied_update(cluster):
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
