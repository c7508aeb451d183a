"""The out-of-memory advice accounts for what the device already holds.

`tfmem.function` at partition_size=20 on a 40-layer MLP with 40 MiB of weights under a
64 MiB emulated device runs out of memory.  The advice names a partition_size and a
device_memory_budget; both must run under the same cap, the budget must hold the
weights the device holds, and the message says what the device holds.  In a fresh
process on this process's kernel path (conftest sets it: oneDNN off unless
TF_ENABLE_ONEDNN_OPTS says otherwise): a real out-of-memory under the cap.  Where
nothing fits beside what the device holds, `suggest` finds nothing (in this process).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfmem

tf1 = tf.compat.v1

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MIB = 64

SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
from tfmem.run.placement import accelerator
rs = np.random.RandomState(0)
# made by a kernel, so that each is allocated on the device: TensorFlow may keep a numpy
# array that happens to be aligned as the tensor's buffer, off the device
ws = [tf.Variable(tf.constant(rs.standard_normal((512, 512)).astype(np.float32)) * 0.04)
      for _ in range(40)]
x = tf.constant(rs.standard_normal((1024, 512)).astype(np.float32))


def step(x):
    with tf.GradientTape() as tape:
        h = x
        for w in ws:
            h = tf.tanh(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(h))
    for w, g in zip(ws, tape.gradient(loss, ws)):
        w.assign_sub(0.01 * g)
    return loss


out = {"resident": accelerator.device_memory("CPU:0")["current"]}
try:
    tfmem.function(step, partition_size=20)(x)
    out["error"] = None
except tfmem.DeviceMemoryError as err:  # (its traceback holds the failed call's tensors)
    out.update(error=str(err), partition_size=err.partition_size, budget=err.budget)
out["after"] = accelerator.device_memory("CPU:0")["current"]
out["advised"] = {}
for name, options in (("partition_size", dict(partition_size=out.get("partition_size"))),
                      ("budget", dict(device_memory_budget=out.get("budget")))):
    try:
        fn = tfmem.function(step, **options)
        fn(x)
        out["advised"][name] = fn.last_step.partitions
    except Exception as other:  # pylint: disable=broad-except
        out["advised"][name] = f"{type(other).__name__}: {str(other)[:2000]}"
print(json.dumps(out))
"""


@pytest.mark.slow
def test_advice_fits_beside_the_weights_the_device_holds():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")  # this process's kernel path
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(CAP_MIB)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["error"], "partition_size=20 did not run out: the test proves nothing"
    assert out["resident"] >= 40 * MIB  # the weights
    assert out["partition_size"] is not None, out["error"]
    # a budget holds what the device holds
    assert out["budget"] >= out["resident"], out["error"]
    assert "the device holds" in out["error"], out["error"]
    # both settings advised run under the same cap
    for name, partitions in out["advised"].items():
        assert isinstance(partitions, int), (name, partitions)


def test_suggest_finds_nothing_where_the_device_holds_too_much(sessions):
    from tfmem.memory import oom  # pylint: disable=import-outside-toplevel
    from tfmem.memory.sizing import Sizing  # pylint: disable=import-outside-toplevel
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [256, 256], name="x")
        h = x
        for i in range(8):
            h = tf.tanh(h * 0.5 + 0.1, name=f"h{i}")
    tfs = tfmem.TFMemSession(sessions(g), partition_size=4)
    feed = {x: np.zeros((256, 256), np.float32)}
    plan = tfs.plan(h, feed)
    sizing = Sizing.of(g, plan.view, {x.name: (256, 256)})
    capacity = 8 * MIB
    alone = oom.suggest(plan, sizing, capacity, failed_peak=capacity)
    assert alone is not None and alone[1] == capacity
    # beside 6 MiB held, a budget of the device still fits, the peak under what is left
    beside = oom.suggest(plan, sizing, capacity, failed_peak=capacity, resident_bytes=6 * MIB)
    assert beside is not None and beside[1] == capacity
    assert beside[2] <= capacity - 6 * MIB
    assert oom.suggest(plan, sizing, capacity, failed_peak=capacity,
                       resident_bytes=capacity) is None
