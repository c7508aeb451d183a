"""A step out of device memory whose bytes were free, in no chunk large enough, teaches
budget mode to hold that much back, not to scale every working set.

Real allocator, fresh processes (emulated accelerator with its cap as one region, as a
GPU's allocator holds its memory; one intra-op and one inter-op thread; each kernel
path): before the step, the program leaves holes in the device's memory, keeping every
other one of twenty 4 MiB buffers, and resets TensorFlow's peak (its own figure).  Budget
mode's replay sees the device's free bytes as one block; the step's 8 MiB activations
find no hole that large, so a plan predicted to fit runs out with TensorFlow's peak plus
the failed request within the device.  The lesson is fragmentation: the request held
back beyond the margin, the step planned again and run again (it ran out before its
updates) until it trains, with plain TensorFlow's loss and weights (`tf.function`,
`Session.run`).  Read as a
shortage of bytes (the working sets scaled until the failed partition's prediction
reaches what the device had), the same failures run out again until the step is lost.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MIB, HOLES, HOLE_MIB, REFERENCE_CAP_MIB = 128, 10, 4, 4096

SCRIPT = r"""
import json, logging, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
cap, holes, hole_mib = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
stage, front_end = sys.argv[4], sys.argv[5]
tfmem.emulate_accelerator(cap)
import numpy as np
import tensorflow as tf
from tfmem.run.placement import accelerator
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
tfmem.reserve_emulated_memory()
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)
WIDTH, LAYERS, BATCH = 256, 6, 8192  # activations of 8 MiB
rs = np.random.RandomState(3)
initial = [rs.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.1 for _ in range(LAYERS)]
data = np.random.RandomState(4).standard_normal((BATCH, WIDTH)).astype(np.float32)
# The state and the input first, on the device, then the holes.
if front_end == "function":
    # made by kernels, so that each is allocated on the device
    ws = [tf.Variable(tf.constant(w) * 1.0) for w in initial]
    x = tf.constant(data) * 1.0

    @tf.function if stage == "reference" else tfmem.function(partition_size="auto")
    def run(x):
        with tf.GradientTape() as tape:
            h = x
            for w in ws:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_mean(tf.square(h))
        for w, g in zip(ws, tape.gradient(loss, ws)):
            w.assign_sub(0.5 * g)
        return loss
    weights = lambda: [w.numpy() for w in ws]
else:
    tf1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        fed = tf1.placeholder(tf.float32, data.shape)
        graph_ws = [tf1.Variable(w) for w in initial]
        h = fed
        for w in graph_ws:
            h = tf.tanh(tf.matmul(h, w))
        graph_loss = tf.reduce_mean(tf.square(h))
        train = tf1.train.GradientDescentOptimizer(0.5).minimize(graph_loss)
        init = tf1.global_variables_initializer()
    sess = tf1.Session(graph=graph, config=tfmem.session_config(tf1.ConfigProto(
        intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)))
    sess.run(init)
    runner = sess if stage == "reference" else tfmem.TFMemSession(sess, partition_size="auto")
    x = data
    run = lambda value: runner.run([train, graph_loss], {fed: value})[1]
    weights = lambda: sess.run(graph_ws)
kept, dropped = [], []  # every other buffer freed: holes
for i in range(holes):
    kept.append(tf.fill([hole_mib << 18], float(i)))
    dropped.append(tf.fill([hole_mib << 18], float(i)))
del dropped
tf.config.experimental.reset_memory_stats("CPU:0")  # the program's own figure
out = {}
try:
    out["loss"] = float(run(x))
except tfmem.DeviceMemoryError as err:
    out["error"] = "\n".join([str(err)] + list(getattr(err, "__notes__", ())))
out["weights"] = [w.tolist() for w in weights()]
out["lessons"] = [(level, message) for level, message in records
                  if message.startswith("Budget mode took this in")]
out["capacity"] = accelerator.device_capacity(None)
print(json.dumps(out))
"""


def _child(stage, cap_mib, onednn, front_end):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFMEM_SCRATCH_CACHE", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cap_mib), str(HOLES),
                           str(HOLE_MIB), stage, front_end],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, f"{stage} process failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.parametrize("front_end", ["function", "session"])
def test_a_step_out_of_memory_in_a_fragmented_device_holds_back_and_trains(front_end, onednn):
    plain = _child("reference", REFERENCE_CAP_MIB, onednn, front_end)
    out = _child("learn", CAP_MIB, onednn, front_end)
    assert "error" not in out, out["error"]
    lessons = out["lessons"]
    assert lessons, "the step did not run out: the holes no longer matter"
    assert out["capacity"] == CAP_MIB << 20
    for level, message in lessons:  # each one read as fragmentation, and the step run again
        assert level == "INFO" and "in no chunk that large" in message, message
        assert "run again at once" in message and "scaled by" not in message, message
    assert out["loss"] == plain["loss"]
    for got, want in zip(out["weights"], plain["weights"]):
        np.testing.assert_array_equal(got, want)
