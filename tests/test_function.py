"""tfmem.function against tf.function: same results, same tracing, shared variables.

Every expected value comes from a plain `tf.function` of the same Python
step on an identical copy of the state (numpy-initialised variables).
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tfmem

Pair = collections.namedtuple("Pair", ["first", "second"])


def make_state(seed=0):
    rs = np.random.RandomState(seed)
    w1 = tf.Variable(rs.standard_normal((8, 16)).astype(np.float32), name="w1")
    w2 = tf.Variable(rs.standard_normal((16, 4)).astype(np.float32), name="w2")
    velocity = [tf.Variable(tf.zeros_like(w)) for w in (w1, w2)]
    return [w1, w2], velocity


def make_step(weights, velocity):
    """A momentum-SGD train step written by hand, returning a nested structure."""
    w1, w2 = weights

    def step(batch, lr=0.05):
        x, y = batch["x"], batch["y"]
        with tf.GradientTape() as tape:
            h = tf.nn.relu(x @ w1)
            h = tf.sin(h) * 0.5 + h
            loss = tf.reduce_mean(tf.square(h @ w2 - y))
        grads = tape.gradient(loss, weights)
        for w, v, g in zip(weights, velocity, grads):
            v.assign(0.9 * v + g)
            w.assign_sub(lr * v)
        return {"loss": loss, "pair": Pair(loss * 2.0, tf.reduce_sum(h, axis=0)), "none": None}

    return step


def batches(count, batch=32, seed=1):
    rs = np.random.RandomState(seed)
    return [{"x": tf.constant(rs.standard_normal((batch, 8)).astype(np.float32)),
             "y": tf.constant(rs.standard_normal((batch, 4)).astype(np.float32))}
            for _ in range(count)]


def assert_same(expected, got):
    """Same structure and types; tensors bit-equal (CPU kernels are deterministic here)."""
    tf.nest.assert_same_structure(expected, got)
    for e, g in zip(tf.nest.flatten(expected), tf.nest.flatten(got)):
        assert type(g) is type(e)
        if tf.is_tensor(e):
            assert g.dtype == e.dtype and g.shape == e.shape
            np.testing.assert_array_equal(g.numpy(), e.numpy())
        else:
            assert g == e


@pytest.mark.parametrize("options", [
    dict(partition_size=10, swap="all", options=tfmem.Options(swap_min_bytes=0)),
    dict(partition_size=7, swap="none"),
    dict(partition_size=25, swap="auto", swap_distance=0, prefetch=0,
         options=tfmem.Options(swap_min_bytes=0)),
    dict(device_memory_budget="1GiB"),
])
def test_results_and_variables_equal_tf_function(options):
    plain_state, tfmem_state = make_state(), make_state()
    plain = tf.function(make_step(*plain_state))
    partitioned = tfmem.function(make_step(*tfmem_state), **options)
    for batch in batches(4):
        assert_same(plain(batch), partitioned(batch))
    for e, g in zip(plain_state[0] + plain_state[1], tfmem_state[0] + tfmem_state[1]):
        np.testing.assert_array_equal(g.numpy(), e.numpy())
    stats = partitioned.last_step
    assert isinstance(stats, tfmem.StepStats)
    plan = partitioned.plan(batches(1)[0])
    tfmem.validate(plan)
    assert stats.partitions == len(plan.partitions)
    if "partition_size" in options:
        assert stats.partitions > 1
        assert all(len(p.ops) <= options["partition_size"] or p.units == 1
                   for p in plan.partitions)
    else:  # the whole step fits the budget: one partition, as plain TensorFlow runs it
        assert stats.partitions == 1
    if options.get("swap") == "all":
        assert stats.swapped_out > 0 and stats.swapped_in >= stats.swapped_out
        assert stats.swapped_out_bytes == sum(
            np.prod(plan.view.tensor(t.tensor).shape) * 4 for t in plan.transfers if t.swapped)
    if options.get("swap") == "none":
        assert stats.swapped_out == 0 and stats.peak_device_handles > 0


def test_decorator_forms():
    w = tf.Variable(2.0)

    @tfmem.function
    def bare(x):
        return x * w + 1.0

    @tfmem.function(partition_size=1)
    def called(x):
        return x * w + 1.0

    def plain(x):
        return x * w + 1.0

    wrapped = tfmem.function(plain, partition_size=1)
    x = tf.constant([1.0, 2.0])
    expected = tf.function(plain)(x)
    for fn in (bare, called, wrapped):
        assert isinstance(fn, tfmem.PartitionedFunction)
        np.testing.assert_array_equal(fn(x).numpy(), expected.numpy())
    assert called.last_step.partitions == len(called.plan(x).partitions) > 1
    assert wrapped.__name__ == "plain"

    class Model:
        def __init__(self, value):
            self.w_plain, self.w_tfmem = tf.Variable(value), tf.Variable(value)

        @tfmem.function(partition_size=1)
        def partitioned(self, x):
            self.w_tfmem.assign_add(x)
            return self.w_tfmem * x

        @tf.function
        def plain(self, x):
            self.w_plain.assign_add(x)
            return self.w_plain * x

    first, second = Model([1.0, 2.0]), Model([5.0, 6.0])
    for model in (first, second, first):  # one traced function per instance, as tf.function
        np.testing.assert_array_equal(model.partitioned(x).numpy(), model.plain(x).numpy())
    assert first.partitioned is first.partitioned and first.partitioned is not second.partitioned
    assert first.partitioned.last_step.partitions > 1


def test_traces_like_tf_function():
    """Python side effects (one per trace) count the same traces as tf.function's."""
    traces = {"plain": 0, "tfmem": 0}

    def counted(key):
        def step(x, scale):
            traces[key] += 1
            return tf.reduce_sum(tf.tanh(x) * scale)
        return step

    plain = tf.function(counted("plain"))
    partitioned = tfmem.function(counted("tfmem"), partition_size=2)
    calls = [(np.ones((2, 3), np.float32), 2.0), (np.ones((2, 3), np.float32) * 3, 2.0),
             (np.ones((4, 3), np.float32), 2.0), (np.ones((4, 3), np.float32), 3.0),
             (np.ones((5, 3), np.float32), 3.0)]
    for x, scale in calls:
        x = tf.constant(x)
        np.testing.assert_array_equal(partitioned(x, scale).numpy(), plain(x, scale).numpy())
        assert traces["tfmem"] == traces["plain"]
    assert traces["plain"] >= 3


def test_input_signature_reuses_one_trace_and_plan():
    traces = []
    signature = [tf.TensorSpec([None, 3], tf.float32)]

    @tfmem.function(input_signature=signature, partition_size=2, swap="all",
                    options=tfmem.Options(swap_min_bytes=0))
    def step(x):
        traces.append(1)
        return tf.reduce_sum(tf.nn.relu(x) * 2.0 + 1.0, axis=1)

    def plain(x):
        return tf.reduce_sum(tf.nn.relu(x) * 2.0 + 1.0, axis=1)

    for rows in (2, 5, 7):
        x = tf.constant(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3) - 4)
        np.testing.assert_array_equal(step(x).numpy(), tf.function(plain)(x).numpy())
    assert len(traces) == 1
    with pytest.raises((TypeError, ValueError)):
        step(tf.constant([1, 2, 3]))  # int32 against a float32 signature: tf.function's error


def test_variables_are_the_programs_own():
    v = tf.Variable(1.0)
    counter = tf.Variable(0, dtype=tf.int64)

    @tfmem.function(partition_size=1)
    def bump(x):
        counter.assign_add(1)
        v.assign(v * x + 1.0)
        return v.read_value() * 2.0

    assert float(bump(tf.constant(3.0))) == 8.0  # inside sees 1.0, updates to 4.0
    assert float(v.numpy()) == 4.0 and int(counter.numpy()) == 1  # visible outside
    v.assign(10.0)  # an update outside ...
    assert float(bump(tf.constant(1.0))) == 22.0  # ... is seen inside
    assert int(counter.numpy()) == 2  # each stateful op ran once per call


def make_control_flow_step(w):
    def step(x, n):
        with tf.GradientTape() as tape:
            h = tf.cond(tf.reduce_sum(x) > 0, lambda: tf.nn.relu(x @ w), lambda: tf.tanh(x @ w))
            h = tf.while_loop(lambda i, a: i < n, lambda i, a: (i + 1, tf.sin(a) + a),
                              (tf.constant(0), h))[1]
            loss = tf.reduce_mean(h * h)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    return step


def test_control_flow_runs_as_one_unit():
    start = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    plain_w, tfmem_w = tf.Variable(start), tf.Variable(start)
    plain = tf.function(make_control_flow_step(plain_w))
    partitioned = tfmem.function(make_control_flow_step(tfmem_w), partition_size=2)
    for sign in (1.0, -1.0):
        x = tf.constant(sign * np.ones((2, 3), np.float32))
        np.testing.assert_array_equal(partitioned(x, tf.constant(3)).numpy(),
                                      plain(x, tf.constant(3)).numpy())
        np.testing.assert_array_equal(tfmem_w.numpy(), plain_w.numpy())
    plan = partitioned.plan(x, tf.constant(3))
    kinds = {p.index: {plan.view.nodes[op].type for op in p.ops} for p in plan.partitions}
    loops = [i for i, types in kinds.items() if types & {"While", "StatelessWhile"}]
    assert len(plan.partitions) > 2 and len(loops) >= 1  # the loop is one op in one partition


def test_edge_outputs_match_tf_function():
    """No outputs, inputs returned as they are, Python values, keyword-only defaults."""
    def make(v):
        def step(x, k, *, scale=2.0):
            v.assign_add(x * scale)
            return x, k, tf.constant(5.0), {"a": x + 1.0, "b": (None, v.read_value())}

        def no_outputs(x):
            v.assign_add(x)
        return step, no_outputs

    plain_v, tfmem_v = tf.Variable(1.0), tf.Variable(1.0)
    plain, plain_none = (tf.function(f) for f in make(plain_v))
    partitioned, partitioned_none = (tfmem.function(f, partition_size=1) for f in make(tfmem_v))
    for args, kwargs in (((tf.constant(2.0), 3), {}), ((np.float32(3.0), 4), {"scale": 0.5}),
                         ((), {"x": tf.constant(1.0), "k": 3})):
        assert_same(plain(*args, **kwargs), partitioned(*args, **kwargs))
    assert plain_none(tf.constant(2.0)) is None and partitioned_none(tf.constant(2.0)) is None
    assert float(tfmem_v.numpy()) == float(plain_v.numpy())


def test_jit_compile_is_refused():
    with pytest.raises(tfmem.UnsupportedGraphError, match="jit_compile"):
        tfmem.function(lambda x: x + 1, jit_compile=True)


def test_state_made_inside_the_graph_is_refused():
    @tfmem.function(partition_size=1)
    def step(x):
        handle = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[], shared_name="inside")
        tf.raw_ops.AssignVariableOp(resource=handle, value=x)
        return tf.raw_ops.ReadVariableOp(resource=handle, dtype=tf.float32) * 2.0

    with pytest.raises(tfmem.UnsupportedGraphError, match="VarHandleOp"):
        step(tf.constant(1.0))


def test_bad_settings_fail_at_decoration():
    with pytest.raises(ValueError, match="partition_size"):
        tfmem.function(lambda x: x, partition_size=0)
    with pytest.raises(ValueError, match="swap"):
        tfmem.function(lambda x: x, swap="sometimes")
    with pytest.raises(ValueError, match="memory size"):
        tfmem.function(lambda x: x, device_memory_budget="lots")


def test_inside_another_tf_function_runs_as_one_call():
    w = tf.Variable(3.0)
    inner = tfmem.function(lambda x: x * w + 1.0, partition_size=1)
    outer = tf.function(lambda x: inner(x) * 2.0)
    assert float(outer(tf.constant(2.0))) == 14.0
    assert inner.last_step is None  # no partitioned call happened


def test_outer_tape_gets_gradients():
    w = tf.Variable(3.0)
    partitioned = tfmem.function(lambda x: tf.sin(x * w) * w, partition_size=1)
    plain = tf.function(lambda x: tf.sin(x * w) * w)
    x = tf.constant(0.5)
    grads = []
    for fn in (plain, partitioned):
        with tf.GradientTape() as tape:
            y = fn(x)
        grads.append(tape.gradient(y, w))
    assert grads[1] is not None
    np.testing.assert_array_equal(grads[1].numpy(), grads[0].numpy())
    assert partitioned.last_step is None  # recorded by tf.function itself, as one call


def test_failed_step_keeps_state_and_the_next_step_runs():
    v = tf.Variable(1.0)

    @tfmem.function(partition_size=1)
    def step(x):
        v.assign_add(1.0)
        checked = tf.debugging.check_numerics(tf.math.log(x), "log of the input")
        return checked * v

    assert float(step(tf.constant(1.0))) == 0.0 and float(v.numpy()) == 2.0
    with pytest.raises(tf.errors.InvalidArgumentError, match="log of the input"):
        step(tf.constant(-1.0))
    assert float(v.numpy()) == 3.0  # the update ran once, and was not repeated
    assert float(step(tf.constant(1.0))) == 0.0 and float(v.numpy()) == 4.0


def test_simulate_predicts_the_swapped_bytes_and_trace_records_the_step(tmp_path):
    import json
    state = make_state()
    path = tmp_path / "step.json"
    partitioned = tfmem.function(make_step(*state), partition_size=10, swap="all", trace=str(path),
                                 options=tfmem.Options(swap_min_bytes=0))
    batch = batches(1)[0]
    trace = partitioned.simulate(batch)
    partitioned(batch)
    assert trace.bytes_to_host == partitioned.last_step.swapped_out_bytes > 0
    events = json.loads(path.read_text())["traceEvents"]
    ran = [e["name"] for e in events if e["ph"] == "X" and e["name"].startswith("partition ")]
    assert ran == [f"partition {i}" for i in range(partitioned.last_step.partitions)]
    assert sum(e["ph"] == "X" and e["name"].startswith("upload") for e in events) > 0


OOM_CHILD = r"""
import json, os, re
import tfmem
tfmem.emulate_accelerator(24)
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)
rng = np.random.default_rng(0)
weights = [tf.Variable(rng.standard_normal((256, 256)).astype(np.float32) * 0.05) for _ in range(16)]

def step(x):
    with tf.GradientTape() as tape:
        h = x
        for w in weights:
            h = tf.nn.relu(h @ w)
            h = tf.sin(h) * 0.5 + h
        loss = tf.reduce_mean(h * h)
    for w, g in zip(weights, tape.gradient(loss, weights)):
        w.assign_sub(0.01 * g)
    return loss

x = tf.constant(rng.standard_normal((1024, 256)).astype(np.float32))
before = [w.numpy().copy() for w in weights]
whole = tfmem.function(step, partition_size=100000)
result = {}
try:
    whole(x)
except tfmem.DeviceMemoryError as err:
    result.update(error=str(err), partition=err.partition, is_tf=isinstance(
        err, tf.errors.ResourceExhaustedError), suggested=err.partition_size)
    # TensorFlow's error, chained, names the op as tf.function's would (not the
    # partition's encoded node name)
    node = re.search(r"\{\{node ([^}]+)\}\}", err.__cause__.message)
    result["cause_node"] = node and node.group(1)
    result["cause_node_traced"] = bool(node) and node.group(1) in {
        op.name for op in whole.get_concrete_function(x).graph.get_operations()}
result["unchanged"] = all(np.array_equal(w.numpy(), b) for w, b in zip(weights, before))
# A budget below the 24 MiB device: after the out-of-memory step above, TensorFlow's BFC
# allocator hands 1 MiB requests whole 1.75-2 MiB chunks (its log of the failure), so the
# same 21-partition plan that peaks at 21.3 MiB in a fresh allocator read 23.3-24.1 MiB
# here with the whole device as budget, and ran out of memory in 1 of 12 processes.
fitted = tfmem.function(step, device_memory_budget="20MiB")
result["loss"] = float(fitted(x))
result["partitions"] = fitted.last_step.partitions
print("TFMEM-RESULTS " + json.dumps(result))
"""


@pytest.mark.slow
def test_out_of_device_memory_names_the_partition_and_releases_the_step():
    """Under an emulated 24 MiB cap: one partition cannot run the step, budget mode can."""
    import os
    from conftest import run_worker

    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"):
        env.pop(name, None)
    result = run_worker(OOM_CHILD, env, timeout=600)
    assert result.get("is_tf"), result  # a DeviceMemoryError, also TF's own error class
    assert result["partition"] == 0 and "partition 0 of 1" in result["error"]
    assert result["suggested"] and f"partition_size={result['suggested']}" in result["error"]
    assert result["unchanged"]  # the failed step updated no variable
    assert result["cause_node_traced"], result["cause_node"]
    # No peak-within-cap check: a step that ran under the hard cap is within it by
    # construction; test_function_measure.py checks the measured figures.
    assert result["partitions"] > 1


def test_an_error_in_a_partition_names_the_op_as_tf_function_does():
    """Partition nodes carry encoded names (tfmem.tf2.sorted_names); TensorFlow's error
    reaches the user with the traced graph's op name, as tf.function's does."""
    w = tf.Variable(tf.ones([4, 4]))

    def step(x):
        h = tf.nn.relu(x @ w)
        h = tf.debugging.check_numerics(tf.math.log(h - 1.0), "the activations went bad")
        return tf.reduce_sum(h * 2.0 + 1.0)

    bad = tf.ones([2, 4]) * -1
    with pytest.raises(tf.errors.InvalidArgumentError) as plain:
        tf.function(step)(bad)
    partitioned = tfmem.function(step, partition_size=2)
    with pytest.raises(tf.errors.InvalidArgumentError) as got:
        partitioned(bad)
    assert len(partitioned.plan(bad).partitions) > 1
    node = "{{node CheckNumerics}}"
    assert node in plain.value.message and node in got.value.message, got.value.message
    assert "the activations went bad" in got.value.message
