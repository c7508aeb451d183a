"""The device memory a resource variable's first in-place update adds (first_updates).

Budget mode plans a request's first step with room for the copies its updates make
of buffers the variables share with kept constants.  Checked against TensorFlow's
own allocator: in a process with the BFC allocator (far above the step), the device's
bytes grow over a plain first step by what `pending_bytes` predicts, and not again
after, under both kernel paths.  Variables of distinct shapes, so that Grappler does
not merge their initial constants into one (see the module's docstring).
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tfmem.memory import first_updates
from tfmem.plan.analyse import analyse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIB = 1 << 10
MIB = 1 << 20

GRAPH = r"""
def build(tf):
    tf1 = tf.compat.v1
    n = 1 << 18
    graph = tf.Graph()
    with graph.as_default():
        def var(name, size, initializer, resource=True):
            return tf1.get_variable(name, [size], initializer=initializer,
                                    use_resource=resource)
        weight = var("weight", n, tf1.glorot_uniform_initializer(seed=1))
        gamma = var("gamma", 2 * n + 256, tf1.ones_initializer())
        ref = var("ref", n + 512, tf1.zeros_initializer(), resource=False)
        counter = var("counter", n + 768, tf1.zeros_initializer())
        momentum = tf1.train.MomentumOptimizer(0.1, 0.9)
        train = tf.group(
            momentum.apply_gradients([(tf.sin(v) + 1.0, v) for v in (weight, gamma, ref)]),
            counter.assign_add(tf.cos(counter.read_value()), read_value=False))
        init = tf1.global_variables_initializer()
    return graph, train, init
"""

PRELUDE = r"""
import json, os, sys
import tfmem
tfmem.emulate_accelerator(4096)
import tensorflow as tf
tf1 = tf.compat.v1

def current():
    return tf.config.experimental.get_memory_info("CPU:0")["current"]
"""

CHILD = GRAPH + PRELUDE + r"""
from tfmem.memory import first_updates
from tfmem.plan.analyse import analyse

graph, train, init = build(tf)
view = analyse([], [train], [])
with tf1.Session(graph=graph) as sess:
    sess.run(init)
    before = current()
    sess.run(train)
    after_first = current()
    sess.run(train)
    after_second = current()
print(json.dumps({"predicted": first_updates.pending_bytes(graph, view),
                  "first": after_first - before, "second": after_second - after_first}))
"""


def _build():
    scope = {}
    exec(GRAPH, scope)  # pylint: disable=exec-used
    return scope["build"](tf)


def test_the_variables_whose_first_update_copies_a_shared_buffer():
    graph, train, _ = _build()
    view = analyse([], [train], [])
    written = first_updates.written_variables(view)
    # ref variables (VariableV2) are not resource variables: their Assign copies at init
    assert written == {"weight", "weight/Momentum", "gamma", "gamma/Momentum", "counter"}
    shared = first_updates.constant_initialised(graph, written)
    # the random weight's initial value is not a constant
    assert shared == {"weight/Momentum", "gamma", "gamma/Momentum", "counter"}
    sizes = {name: view.sources[name].state_bytes for name in shared}
    assert first_updates.pending_bytes(graph, view) == sum(sizes.values())
    assert first_updates.pending_bytes(graph, view, owned={"gamma", "counter"}) == sum(
        size for name, size in sizes.items() if name not in ("gamma", "counter"))


def test_an_initializing_request_sets_these_variables_from_constants():
    graph, _, init = _build()
    assigned = first_updates.assigned(graph, analyse([], [init], []))
    # ref variables count: their constants are kept too
    assert set(assigned) == {"weight/Momentum", "gamma", "gamma/Momentum", "ref",
                             "ref/Momentum", "counter"}


@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.slow
def test_the_first_step_grows_the_device_by_the_predicted_copies(onednn):
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          cwd=ROOT, timeout=300,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["predicted"] > 4 * (1 << 20), result  # the premise: copies worth checking
    # TensorFlow's figure counts BFC chunks: a copy may take a chunk larger than its
    # request, by less than the request (the split rule), which the predicted requests do
    # not see: once, in the full suite, 7,340,800 bytes against 6,296,576 predicted (one
    # copy in a chunk 1 MiB over).  At most one largest copy over, never under.
    largest_copy = (2 * (1 << 18) + 256) * 4
    assert -64 * KIB <= result["first"] - result["predicted"] <= largest_copy, result
    assert result["second"] == 0, result


MATRICES = r"""
def build(tf):
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        def var(name, shape, initializer):
            return tf1.get_variable(name, shape, initializer=initializer, use_resource=True)
        weight = var("weight", [1024, 512], tf1.glorot_uniform_initializer(seed=1))
        scale = var("scale", [512, 1024], tf1.ones_initializer())
        counter = var("counter", [256, 1024], tf1.zeros_initializer())
        momentum = tf1.train.MomentumOptimizer(0.1, 0.9)
        train = tf.group(
            momentum.apply_gradients([(tf.sin(v) + 1.0, v) for v in (weight, scale)]),
            counter.assign_add(tf.cos(counter.read_value()), read_value=False))
        init = tf1.global_variables_initializer()
    return graph, train, init
"""

RELEASE_CHILD = MATRICES + PRELUDE + r"""
def values(run, graph):
    with graph.as_default():
        return [v.tolist() for v in run(tf1.global_variables())]

# (bytes held after init and two steps, the values then, the values after a second
# init: the seeded random weight draws its stream's next numbers in plain TensorFlow)
def train_and_init_again(run, init, train, graph):
    start = current()
    run(init)
    run(train)
    run(train)
    held = current() - start
    trained = values(run, graph)
    run(init)  # through tfmem: compiled once more (the executor was released), then kept
    return held, trained, values(run, graph)

graph, train, init = build(tf)
with graph.as_default():
    state = sum(v.shape.num_elements() * 4 for v in tf1.global_variables())
with tf1.Session(graph=graph) as sess:
    plain = train_and_init_again(sess.run, init, train, graph)
graph, train, init = build(tf)
tfs = tfmem.TFMemSession(tf1.Session(graph=graph), partition_size=200)
tfmem_run = train_and_init_again(tfs.run, init, train, graph)
version = graph.version
tfs.run(init)
print(json.dumps({"state": state, "plain": plain[0], "tfmem": tfmem_run[0],
                  "trained equal": plain[1] == tfmem_run[1],
                  "initialised again equal": plain[2] == tfmem_run[2],
                  "kept": graph.version == version}))
"""


TWINS = PRELUDE + r"""
graph = tf.Graph()
with graph.as_default():
    twins = [tf1.get_variable(f"twin{i}", [1024, 1024], initializer=tf1.zeros_initializer(),
                              use_resource=True) for i in range(3)]
    x = tf1.placeholder(tf.float32, [1024, 1024])
    train = tf.group(*[t.assign_add(tf.sin(x) + float(i), read_value=False)
                       for i, t in enumerate(twins)])
    init = tf1.global_variables_initializer()
state = 3 * (4 << 20)
# one thread per pool: the step's temporaries in one order, so its peak is a property of
# the buffers, not of how the executor's threads interleave on a loaded machine
config = tf1.ConfigProto(inter_op_parallelism_threads=1, intra_op_parallelism_threads=1)
sess = tf1.Session(graph=graph, config=config)
tfs = tfmem.TFMemSession(sess, partition_size=200)
start = current()
# unchained, the initializer's equal zeros are merged into one buffer; chained copies
# are not (op_order.chained_order), and then every variable has its own from the start
tfmem.TFMemSession(sess, partition_size=200,
                   options=tfmem.Options(chain_copies=False)).run(init)
after_init = current() - start
peaks = []
for _ in range(2):
    tf.config.experimental.reset_memory_stats("CPU:0")
    tfs.run(train, {x: [[0.5] * 1024] * 1024})
    peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
print(json.dumps({"state": state, "after_init": after_init, "peaks": peaks,
                  "after": current() - start}))
"""


@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.slow
def test_variables_sharing_one_merged_value_need_nothing_past_the_state(onednn):
    """Three variables set to equal zeros share the one buffer TensorFlow merged them
    into; once tfmem released the initializer, the first step's copies of it only fill
    what the state already counts: its peak is no higher than the second step's, so
    budget mode counts nothing pending for them (it counted 25.6 MiB at ResNet-186)."""
    done = subprocess.run([sys.executable, "-c", TWINS], capture_output=True, text=True,
                          cwd=ROOT, timeout=300,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # the premise: the three share one buffer before their first update
    assert result["after_init"] <= result["state"] - 2 * (4 << 20) + MIB, result
    first, second = result["peaks"]
    assert first <= second + MIB, result
    assert result["after"] <= result["state"] + 4 * MIB, result


@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.slow
def test_an_initializer_run_through_tfmem_keeps_no_constants(onednn):
    """TFMemSession releases the executor of a request that sets variables from
    constants after its first step: the device then holds the state alone, where a plain
    `sess.run(init)` keeps every constant beside its variable for good.  Matrices, as
    the experiments' models have: for a few 1-D variables (2^19 + 256 floats) TensorFlow
    kept a constant until the session closed, released executor or not (not explained)."""
    done = subprocess.run([sys.executable, "-c", RELEASE_CHILD], capture_output=True,
                          text=True, cwd=ROOT, timeout=300,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["trained equal"] and result["initialised again equal"], result
    # The BFC allocator counts whole chunks, and serves a buffer from a free chunk of
    # less than twice its size: a freed constant's chunk reused by a smaller buffer counts
    # up to its size more (counter: 1 MiB in a 2 MiB chunk).  The largest is 2 MiB.
    largest = 2 * MIB
    assert result["tfmem"] <= result["state"] + largest, result
    # the zeros and ones plain TensorFlow keeps: two momentum slots, scale, counter
    assert result["plain"] - result["tfmem"] >= 7 * MIB - largest, result
    assert result["kept"], "an initializer run a third time compiles nothing more"
