"""Shared helpers for the tfmem test suite.

The suite checks one property over and over: a request run through
``tfmem.TFMemSession`` returns what plain ``tf.compat.v1.Session.run`` returns
for the same graph, feeds and state.  Expected values always come from a plain
session, never from hard-coded numbers.

Two ways to get a fair comparison are used:

* build the same graph twice with a builder function (numpy-initialised
  variables, fixed data) and run one copy plainly, the other through tfmem;
* one graph, two sessions (one plain, one wrapped); both run the initializer.
"""

import os
import signal

os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
# The kernel path of the tests that run in this process, never the machine's default
# (TensorFlow turns oneDNN on by itself on CPUs with AVX-512).  Tests that must cover
# both paths start subprocesses with it set; `TF_ENABLE_ONEDNN_OPTS=1 python -m pytest`
# runs this process's tests on the other path.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import collections  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfmem  # noqa: E402
from tfmem.run.placement import accelerator  # noqa: E402

tf1 = tf.compat.v1

# Tests whose premise is a kernel's scratch in the device's allocator: Eigen's
# convolution gradients take im2col buffers of MiBs there, oneDNN's kernels keep their
# scratch elsewhere, so on that kernel path the premise does not hold.
eigen_kernels_only = pytest.mark.skipif(
    os.environ["TF_ENABLE_ONEDNN_OPTS"].strip().lower() in ("1", "true", "yes", "on"),
    reason="needs Eigen's convolution scratch in the device allocator (TF_ENABLE_ONEDNN_OPTS=0)")

RTOL = 1e-4
ATOL = 1e-6


# --------------------------------------------------------------------------
# sessions


MEMORY_KINDS = ("accelerator", "cpu")


@pytest.fixture(autouse=True)
def device_memory(request, monkeypatch):
    """Which memory sessions see: "accelerator" (the default) or the real "cpu".

    On a plain CPU session swap="auto" swaps nothing (a host copy frees no
    memory), so by default the suite runs as if its session had an
    accelerator's own memory, where "auto" swaps.  A test that parametrizes
    this fixture indirectly (`both_memories`) also runs on the real CPU
    default, unpatched.
    """
    kind = getattr(request, "param", "accelerator")
    assert kind in MEMORY_KINDS, kind
    if kind == "accelerator":
        monkeypatch.setattr(accelerator, "has_own_memory", lambda session: True)
    return kind


both_memories = pytest.mark.parametrize("device_memory", MEMORY_KINDS, indirect=True)


def session_config():
    """Small, deterministic-enough session config for 2-core CI machines."""
    return tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)


def new_session(graph):
    return tf1.Session(graph=graph, config=session_config())


def tfmem_config():
    """session_config() with Grappler off (tfmem.session_config): a partitioned step and
    a plain one run the same kernels, so their results compare bit for bit."""
    return tfmem.session_config(session_config())


@pytest.fixture
def closed_at_teardown():
    """``keep(*sessions)`` -> the sessions, each closed when the test ends."""
    opened = []

    def keep(*sessions):
        opened.extend(sessions)
        return sessions
    yield keep
    for session in opened:
        session.close()


@pytest.fixture
def two_sessions(closed_at_teardown):
    """Factory: ``make(graph)`` -> (plain session, session to wrap), both with
    tfmem_config() and closed at teardown."""
    return lambda graph: closed_at_teardown(tf1.Session(graph=graph, config=tfmem_config()),
                                            tf1.Session(graph=graph, config=tfmem_config()))


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test: a process started in the background by
    a shell without job control inherits SIGINT ignored, where a Ctrl-C does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def sessions():
    """Factory: ``make(graph)`` -> new session closed at teardown."""
    opened = []

    def make(graph):
        s = new_session(graph)
        opened.append(s)
        return s

    yield make
    for s in opened:
        try:
            s.close()
        except Exception:  # pragma: no cover - closing twice etc.
            pass


def _pair_factory(sessions, closed_at_teardown, own_session):
    def make(graph, partition_size, init=None):
        plain = sessions(graph)
        if own_session:  # tfmem.Session: a session of its own, on a copy of what runs
            tfs, = closed_at_teardown(tfmem.Session(graph=graph, config=session_config(),
                                                    partition_size=partition_size))
        else:
            tfs = tfmem.TFMemSession(sessions(graph), partition_size=partition_size)
        if init is not None:
            plain.run(init)
            tfs.run(init)
        return plain, tfs

    return make


@pytest.fixture
def pair(sessions, closed_at_teardown):
    """Factory: ``make(graph, partition_size, init=None)`` -> (plain, tfs).

    Two sessions on the same graph; ``plain`` is a ``tf.compat.v1.Session``,
    ``tfs`` a ``TFMemSession`` around a second one.  ``init`` (op or list) is
    run in both sessions, the wrapped one through the wrapper.
    """
    return _pair_factory(sessions, closed_at_teardown, own_session=False)


@pytest.fixture(params=["wrapped", "own"])
def both_pairs(request, sessions, closed_at_teardown):
    """As `pair`, and again with ``tfs`` a `tfmem.Session` (its session graph a copy of
    what requests reach, see run/compiling/graph_copy.py; Grappler off)."""
    return _pair_factory(sessions, closed_at_teardown, own_session=request.param == "own")


# --------------------------------------------------------------------------
# control flow version toggle


@pytest.fixture(params=["v2", "v1"])
def control_flow(request):
    """Build the test's graph with v2 (default) or v1 control flow.

    The global toggle is restored afterwards whatever happens.
    """
    was_v2 = tf1.control_flow_v2_enabled()
    try:
        if request.param == "v1":
            tf1.disable_control_flow_v2()
        else:
            tf1.enable_control_flow_v2()
        yield request.param
    finally:
        if was_v2:
            tf1.enable_control_flow_v2()
        else:
            tf1.disable_control_flow_v2()


def op_types(graph):
    return {op.type for op in graph.get_operations()}


# --------------------------------------------------------------------------
# comparing results


def assert_same_result(expected, got, rtol=RTOL, atol=ATOL, path="result"):
    """Recursively compare a Session.run result with a TFMemSession.run result.

    Structure types must match exactly (list vs tuple vs namedtuple vs dict
    type); leaves are compared by dtype, shape and value.
    """
    if expected is None:
        assert got is None, f"{path}: expected None, got {got!r}"
        return
    if isinstance(expected, tf1.SparseTensorValue):
        assert isinstance(got, tf1.SparseTensorValue), f"{path}: expected SparseTensorValue, got {type(got)}"
        for field in expected._fields:
            assert_same_result(getattr(expected, field), getattr(got, field), rtol, atol, f"{path}.{field}")
        return
    if isinstance(expected, dict):
        assert type(got) is type(expected), f"{path}: expected {type(expected)}, got {type(got)}"
        assert list(got.keys()) == list(expected.keys()), f"{path}: keys differ"
        for k in expected:
            assert_same_result(expected[k], got[k], rtol, atol, f"{path}[{k!r}]")
        return
    if isinstance(expected, (list, tuple)):
        assert type(got) is type(expected), f"{path}: expected {type(expected)}, got {type(got)}"
        assert len(got) == len(expected), f"{path}: length {len(got)} != {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same_result(e, g, rtol, atol, f"{path}[{i}]")
        return
    if isinstance(expected, bytes):
        assert got == expected, f"{path}: {got!r} != {expected!r}"
        return
    e = np.asarray(expected)
    assert isinstance(got, (np.ndarray, np.generic, bytes)), f"{path}: expected numpy value, got {type(got)}"
    g = np.asarray(got)
    assert g.dtype == e.dtype, f"{path}: dtype {g.dtype} != {e.dtype}"
    assert g.shape == e.shape, f"{path}: shape {g.shape} != {e.shape}"
    if e.dtype.kind in "fc":
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=path)
    else:
        np.testing.assert_array_equal(g, e, err_msg=path)


# --------------------------------------------------------------------------
# plans


def plan_ops(plan):
    return [name for p in plan.partitions for name in p.ops]


def _stays_by_reference(tensor):
    """Resource and ref tensors are mapped to the original op, never transferred."""
    return tensor.dtype == tf.resource or tensor.dtype._is_ref_dtype


def check_plan(plan, graph, partition_size=None, strict_size=True):
    """Invariants checked from outside, independently of ``tfmem.validate``.

    * ``validate`` accepts the plan;
    * partitions are indexed 0..n-1, non-empty, and (``strict_size``) hold at
      most ``partition_size`` ops;
    * every op is an op of ``graph`` and sits in exactly one partition;
    * every data edge between plan ops goes forward (producer partition <=
      consumer partition); every non-resource tensor crossing partitions is
      described by a Transfer whose producer/consumers match.
    """
    assert tfmem.validate(plan) is None
    parts = plan.partitions
    assert isinstance(parts, tuple) and len(parts) >= 1
    assert [p.index for p in parts] == list(range(len(parts)))
    if partition_size is not None:
        assert plan.partition_size == partition_size
    where = {}
    for p in parts:
        assert len(p.ops) >= 1, f"partition {p.index} is empty"
        if strict_size and partition_size is not None:  # one unit may be larger (units.py)
            assert len(p.ops) <= partition_size or p.units == 1, \
                f"partition {p.index} has {len(p.ops)} ops in {p.units} units"
        for name in p.ops:
            assert isinstance(name, str)
            assert name not in where, f"op {name} in partitions {where[name]} and {p.index}"
            where[name] = p.index
            graph.get_operation_by_name(name)  # raises KeyError if unknown
    transfers = {t.tensor: t for t in plan.transfers}
    for t in plan.transfers:
        assert all(c > t.producer for c in t.consumers), t
        assert where[graph.get_tensor_by_name(t.tensor).op.name] == t.producer, t
    for name, idx in where.items():
        op = graph.get_operation_by_name(name)
        for inp in op.inputs:
            src = inp.op.name
            if src not in where:
                continue
            assert where[src] <= idx, f"{src} (partition {where[src]}) feeds {name} (partition {idx})"
            if where[src] < idx and not _stays_by_reference(inp):
                assert inp.name in transfers, f"crossing tensor {inp.name} has no Transfer"
                assert transfers[inp.name].producer == where[src]
                assert idx in transfers[inp.name].consumers
        for dep in op.control_inputs:
            if dep.name in where:
                assert where[dep.name] <= idx, f"control edge {dep.name} -> {name} goes backwards"
    return where


# --------------------------------------------------------------------------
# models


def _variable(rs, shape, name, use_resource, scale=0.5):
    init = (rs.standard_normal(shape) * scale).astype(np.float32)
    return tf1.Variable(init, name=name, use_resource=use_resource)


def build_mlp(optimizer="momentum", use_resource=True, seed=0):
    """Tiny 2-layer MLP with a softmax loss, numpy-initialised variables."""
    rs = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        w1 = _variable(rs, (4, 6), "w1", use_resource)
        b1 = _variable(rs, (6,), "b1", use_resource, 0.1)
        w2 = _variable(rs, (6, 3), "w2", use_resource)
        b2 = _variable(rs, (3,), "b2", use_resource, 0.1)
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        logits = tf.matmul(h, w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        if optimizer == "momentum":
            opt = tf1.train.MomentumOptimizer(0.1, momentum=0.9)
        elif optimizer == "adam":
            opt = tf1.train.AdamOptimizer(0.05)
        elif optimizer == "sgd":
            opt = tf1.train.GradientDescentOptimizer(0.1)
        else:
            raise ValueError(optimizer)
        train = opt.minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    data = [
        {x: rs.standard_normal((8, 4)).astype(np.float32), y: rs.randint(0, 3, size=8).astype(np.int32)}
        for _ in range(5)
    ]
    return types.SimpleNamespace(
        graph=g, x=x, y=y, loss=loss, train=train, init=init, weights=[w1, b1, w2, b2], data=data
    )


def build_convnet(use_resource=True, seed=0):
    """Small convnet with hand-made batch-norm style moving averages.

    The moving averages and a step counter are updated through
    UPDATE_OPS-style control dependencies on the train op only.
    """
    rs = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 6, 6, 2], name="x")
        y = tf1.placeholder(tf.int32, [None], name="y")
        k = _variable(rs, (3, 3, 2, 4), "conv_k", use_resource)
        conv = tf.nn.conv2d(x, k, strides=[1, 1, 1, 1], padding="SAME")
        mean, var = tf.nn.moments(conv, axes=[0, 1, 2])
        moving_mean = tf1.Variable(np.zeros(4, np.float32), trainable=False, name="moving_mean", use_resource=use_resource)
        moving_var = tf1.Variable(np.ones(4, np.float32), trainable=False, name="moving_var", use_resource=use_resource)
        steps = tf1.Variable(0, dtype=tf.int64, trainable=False, name="bn_steps", use_resource=use_resource)
        updates = [
            tf1.assign(moving_mean, moving_mean * 0.9 + mean * 0.1),
            tf1.assign(moving_var, moving_var * 0.9 + var * 0.1),
            tf1.assign_add(steps, 1),
        ]
        gamma = tf1.Variable(np.ones(4, np.float32), name="gamma", use_resource=use_resource)
        beta = tf1.Variable(np.zeros(4, np.float32), name="beta", use_resource=use_resource)
        bn = tf.nn.batch_normalization(conv, mean, var, beta, gamma, 1e-3)
        act = tf.nn.relu(bn)
        pooled = tf.reduce_mean(act, axis=[1, 2])
        w = _variable(rs, (4, 3), "dense_w", use_resource)
        logits = tf.matmul(pooled, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        with tf.control_dependencies(updates):
            train = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
    data = [
        {x: rs.standard_normal((4, 6, 6, 2)).astype(np.float32), y: rs.randint(0, 3, size=4).astype(np.int32)}
        for _ in range(4)
    ]
    return types.SimpleNamespace(
        graph=g, x=x, y=y, loss=loss, train=train, init=init, data=data,
        moving=[moving_mean, moving_var], steps=steps, weights=[k, gamma, beta, w],
    )


def build_chain(length=10, seed=0):
    """Small graph: placeholder -> matmul with a variable -> chain of elementwise ops.

    Also holds an unrelated branch that no request needs.
    """
    rs = np.random.RandomState(seed)
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [2, 3], name="x")
        w = _variable(rs, (3, 3), "w", True)
        h = tf.matmul(x, w, name="h")
        t = h
        for i in range(length):
            t = tf.add(t * 0.5, h, name=f"c{i}") if i % 2 else tf.tanh(t, name=f"c{i}")
        out = tf.reduce_sum(t, name="out")
        unrelated = tf.multiply(tf.constant(3.0, name="u_c"), 2.0, name="unrelated")
        init = tf1.global_variables_initializer()
    feed = {x: rs.standard_normal((2, 3)).astype(np.float32)}
    return types.SimpleNamespace(graph=g, x=x, w=w, h=h, t=t, out=out, unrelated=unrelated, init=init, feed=feed)


Point = collections.namedtuple("Point", ["a", "b"])


# The worker of `one_partition_peak`; %s is the source defining `body`.
_ONE_PARTITION_PEAK = r"""
import json
import numpy as np
import tensorflow as tf
import tfmem
from tfmem.memory import op_order
from tfmem.run.placement import accelerator

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
%s
rng = np.random.default_rng(0)
m = tf.constant(rng.standard_normal((1024, 1024)).astype(np.float32) / 32)
v = tf.constant(rng.standard_normal(1 << 17).astype(np.float32))
step = tfmem.function(body, partition_size=1000)
peaks = []
for _ in range(5):
    resident = accelerator.device_memory("CPU:0")["current"]
    accelerator.reset_peak("CPU:0")
    total, smalls = step(m, v)
    total.numpy()
    del total, smalls
    peaks.append(accelerator.device_memory("CPU:0")["peak"] - resident)
report = step.memory_report()
plan = step.plan(m, v)
figures = dict(measured=max(peaks[1:]), predicted=report.predicted_device_peak,
               chunks=report.predicted_device_peak_chunks, partitions=len(plan.partitions),
               dissolved=sorted(op_order.dissolved_identities(plan.view,
                                                              plan.partitions[0].ops)))
print("TFMEM-RESULTS " + json.dumps(figures))
"""


def one_partition_peak(body, onednn):
    """Figures of `body(m, v)` (Python source defining it) as a tfmem.function of one
    partition over a 1024 x 1024 matrix and a 0.5 MiB vector, called five times in a fresh
    process (two inter-op threads, one intra-op thread, a BFC allocator far above the
    step, the kernel path `onednn`): `measured`, the most a call after the first took
    above what the device held before it; `predicted` and `chunks`, the prediction
    requested and in the allocator's chunks; `partitions`; `dissolved`, the IdentityN ops
    the emulated executor removes (op_order.dissolved_identities)."""
    from tfmem.cli import child_env  # pylint: disable=import-outside-toplevel
    figures = run_worker(_ONE_PARTITION_PEAK % body, child_env.child_env(onednn=onednn),
                         timeout=300)
    print(f"\nmeasured {figures['measured'] / (1 << 20):.2f} MiB, predicted "
          f"{figures['predicted'] / (1 << 20):.2f} MiB requested, "
          f"{figures['chunks'] / (1 << 20):.2f} in the allocator's chunks")
    return figures


def run_worker(code, env, timeout):
    """Run Python `code` in a fresh process with environment `env`; the JSON it printed on
    its last "TFMEM-RESULTS " line.  The process never outlives the call."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    worker = subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        return worker_results(worker, timeout)
    finally:
        worker.kill()
        worker.wait()


def worker_results(worker, timeout):
    """The JSON a worker subprocess printed on its last "TFMEM-RESULTS " line."""
    import json  # pylint: disable=import-outside-toplevel
    stdout, stderr = worker.communicate(timeout=timeout)
    lines = [line for line in stdout.splitlines() if line.startswith("TFMEM-RESULTS ")]
    assert worker.returncode == 0 and lines, (
        f"worker failed ({worker.returncode}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return json.loads(lines[-1][len("TFMEM-RESULTS "):])
