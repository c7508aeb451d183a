"""Budget mode runs what changes state last, so that a step out of device memory in its
backward pass has changed nothing and runs again.

A training step with a moving average in its forward pass (as Keras's
BatchNormalization keeps one) and an update per weight: the depth-first order
runs the moving average's assign in the forward pass and each update as its
gradient comes, so a step out of memory in the backward pass has changed
state and is lost.  Budget mode moves every update, and what depends on one,
after the rest, a partition starting there: in a plan of several partitions
every one before the first update changes nothing (checked on the plan).

The out-of-memory is real, under the emulated accelerator in fresh processes (one
intra-op and one inter-op thread, each kernel path): the gradient of one layer tiles
a slice of its input by multiples a py_func returns, so budget mode predicts nothing
for the tiled tensor and its first plan runs out in the backward pass.  The step is
planned again with the tile's bytes taken in, run again once, and its loss, weights and
moving average equal plain `tf.function`'s one step in an uncapped process.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.memory import budget
from tfmem.plan import updates

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDTH, LAYERS, BATCH = 128, 6, 1024
# The budget, as a share of the one-partition prediction: a few partitions.
SHARE = 0.8
# The cap and tiles (64 KiB each) under which the first plan runs out in the backward
# pass and a later one fits; a cap far above the step gives plain's results.
CAP_MIB, TILES, REFERENCE_CAP_MIB = 36, 192, 4096


def _step():
    """(step, weights, moving average): an MLP trained by SGD whose first layer's mean
    activation is kept as a moving average."""
    rs = np.random.RandomState(3)
    ws = [tf.Variable(rs.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.2)
          for _ in range(LAYERS)]
    average = tf.Variable(tf.zeros([WIDTH]))

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for i, w in enumerate(ws):
                h = tf.tanh(tf.matmul(h, w))
                if i == 0:
                    average.assign(0.9 * average + 0.1 * tf.reduce_mean(h, 0))
            loss = tf.reduce_mean(tf.square(h))
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(0.5 * g)
        return loss
    return step, ws, average


def _data():
    return tf.constant(np.random.RandomState(4).standard_normal((BATCH, WIDTH))
                       .astype(np.float32))


def _budget(x):
    """A budget under the one-partition prediction: several partitions."""
    step, _, _ = _step()
    whole = tfmem.function(step, device_memory_budget="1GiB").simulate(x).peak_device
    return int(whole * SHARE / (1 - budget.DEFAULT_MARGIN))


def test_budget_mode_changes_state_only_after_everything_else():
    x = _data()
    step, _, _ = _step()
    plan = tfmem.function(step, device_memory_budget=_budget(x)).plan(x)
    changing = updates.update_partitions(plan)
    assert len(plan.partitions) > 1 and changing
    late = updates.after_updates(plan.view)
    first = min(changing)
    assert all(name in late for p in plan.partitions[first:] for name in p.ops)
    # a step out of memory in any partition before them changed nothing
    assert all(updates.unchanged_before(plan, index) for index in range(first))


SCRIPT = r"""
import json, logging, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
stage, TILES = sys.argv[2], int(sys.argv[3])
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
if stage != "reference":  # one region of the cap, as a GPU's allocator holds its memory
    tfmem.reserve_emulated_memory()
WIDTH, LAYERS, BATCH = 256, 8, 2048
rs = np.random.RandomState(3)
initial = [rs.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.1 for _ in range(LAYERS)]
data = np.random.RandomState(4).standard_normal((BATCH, WIDTH)).astype(np.float32)


def multiples():  # values no shape inference sees: the tiled tensor's size is unknown
    return np.array([TILES, 1], np.int32)


@tf.custom_gradient
def widened(h):
    def grad(dy):  # megabytes predicted as nothing, in the backward pass
        wide = tf.tile(dy[:, :8], tf.numpy_function(multiples, [], tf.int32, stateful=False))
        return dy * (1.0 + 0.0 * tf.reduce_mean(wide))
    return tf.identity(h), grad


records = []
handler = logging.Handler()
handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)
ws = [tf.Variable(w) for w in initial]
average = tf.Variable(tf.zeros([WIDTH]))


def step(x):
    with tf.GradientTape() as tape:
        h = x
        for i, w in enumerate(ws):
            h = tf.tanh(tf.matmul(h, w))
            if i == 0:  # a moving average, updated in the forward pass
                average.assign(0.9 * average + 0.1 * tf.reduce_mean(h, 0))
            if i == LAYERS - 3:
                h = widened(h)
        loss = tf.reduce_mean(tf.square(h))
    for w, g in zip(ws, tape.gradient(loss, ws)):
        w.assign_sub(0.5 * g)
    return loss


x = tf.constant(data)
run = tf.function(step) if stage == "reference" else tfmem.function(step, partition_size="auto")
out = {}
try:
    out["loss"] = float(run(x))
except tfmem.DeviceMemoryError as err:
    out["error"] = "\n".join([str(err)] + list(getattr(err, "__notes__", ())))
out["weights"] = [w.numpy().tolist() for w in ws]
out["average"] = average.numpy().tolist()
out["run_again"] = [level for level, message in records if "run again at once" in message]
print(json.dumps(out))
"""


def _child(stage, cap_mib, onednn):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFMEM_SCRATCH_CACHE", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cap_mib), stage, str(TILES)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, f"{stage} process failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["0", "1"])
def test_a_step_out_of_memory_in_its_backward_pass_runs_again(onednn):
    plain = _child("reference", REFERENCE_CAP_MIB, onednn)
    out = _child("learn", CAP_MIB, onednn)
    assert "error" not in out, out["error"]
    # once: the error names the tile and its bytes, which the model takes in (one op's
    # miss, not a factor on every partition)
    assert out["run_again"] == ["INFO"]
    # the moving average and the updates applied once, as in plain's one step
    assert out["loss"] == plain["loss"]
    np.testing.assert_array_equal(out["average"], plain["average"])
    for got, want in zip(out["weights"], plain["weights"]):
        np.testing.assert_array_equal(got, want)
