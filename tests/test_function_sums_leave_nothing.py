"""A tfmem.function step leaves nothing on the device: a large sum of three tensors
(AddN), which Grappler's memory optimizer would rewrite into a temporary variable
and a folded zeros constant that the function's kernel holds for as long as it
lives (tfmem.tf2.call_options).

Plain `tf.function` of the same step is run beside it: it must leave that
constant behind, or the step is too small to show anything.  One fresh process
per kernel path, under the emulated accelerator (TensorFlow's figures); each
prints one JSON line.
"""

import json
import os
import subprocess
import sys

import pytest

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR_MIB = 56  # three of them put Grappler's estimate over 80 % of a CPU's 256 MiB

SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(1024)
import numpy as np
import tensorflow as tf
from tfmem.run.placement import accelerator
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
in_use = lambda: accelerator.device_memory("CPU:0")["current"]

def step(a, b, c):
    return tf.add_n([a * 2.0, b * 3.0, c * 4.0])

size = int(sys.argv[1]) << 18  # floats
xs = [tf.constant(np.arange(size, dtype=np.float32) % (7 + i)) for i in range(3)]
out = {}
for name, fn in [("tfmem", tfmem.function(step, partition_size=int(sys.argv[2]))),
                 ("plain", tf.function(step))]:
    before = in_use()
    result = fn(*xs)
    out[name] = {"sum": float(tf.reduce_sum(result)), "head": result.numpy()[:5].tolist()}
    del result
    out[name]["left_without_result"] = in_use() - before
print(json.dumps(out))
"""


def _run(onednn, partition_size):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(TENSOR_MIB), str(partition_size)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("onednn", ["0", "1"])
def test_large_sum_leaves_nothing_on_the_device(onednn):
    # partition_size 2: the sum's inputs come from another partition, as in a backward pass
    out = _run(onednn, 2)
    plain, partitioned = out["plain"], out["tfmem"]
    assert plain["left_without_result"] >= TENSOR_MIB * MIB, (
        "plain tf.function no longer keeps a constant of the sum's size: the step shows "
        f"nothing ({plain})")
    assert partitioned["left_without_result"] < MIB, partitioned
    assert partitioned["head"] == plain["head"] and partitioned["sum"] == plain["sum"]
