"""Fed arrays stay out of device memory: each partition's run reads an aligned copy in place.

TensorFlow reads a fed numeric array in place when its data starts on a 64-byte
boundary, and copies any other into an allocator for every run it is fed to.  In a
process whose device allocator is TensorFlow's CPU allocator from its first session on
(the emulated accelerator after `reserve_emulated_memory`), that copy is device
memory the simulator does not count: a 4 MiB batch fed to three partitions would be
4 MiB more in each.  tfmem feeds its partitions one aligned copy per step.

Measured in a fresh process (the allocator layout is set when TensorFlow starts).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfmem.cli.child_env import child_env
from tfmem.run.front_end.request import aligned_feed
from tfmem.run.executing.buffers import ALIGNMENT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
FED_BYTES = 4 * MIB

SCRIPT = r"""
import json, sys
import numpy as np
import tensorflow as tf
import tfmem
tfmem.reserve_emulated_memory()
from tfmem.run.placement import accelerator
tf1 = tf.compat.v1
PINNED = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
n = int(sys.argv[1]) // 4

graph = tf.Graph()
with graph.as_default():
    x = tf1.placeholder(tf.float32, [n], name="x")
    h = x
    for i in range(4):  # each layer reads the fed x again: several partitions read it
        h = tf.sin(h) * x + float(i)
    total = tf.reduce_sum(h, name="total")


def placed(offset):
    raw = np.empty(4 * n + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    array = raw[start:start + 4 * n].view(np.float32)
    array[...] = np.linspace(-1, 1, n, dtype=np.float32)
    return array


def peak(run, value):
    run(total, {x: value})  # warm
    accelerator.reset_peak("CPU:0")  # this process's own measurement
    result = float(run(total, {x: value}))
    return result, accelerator.device_memory("CPU:0")["peak"] - accelerator.device_memory("CPU:0")["current"]


sess = tf1.Session(graph=graph, config=PINNED)
out = {"plain_aligned": peak(sess.run, placed(0)), "plain_unaligned": peak(sess.run, placed(16))}
tfs = tfmem.TFMemSession(sess, partition_size=3)
out["tfmem_unaligned"] = peak(tfs.run, placed(16))
trace = tfs.simulate(total, {x: placed(16)})
out["partitions"] = len(tfs.plan(total, {x: placed(16)}).partitions)
out["predicted_chunks"] = trace.peak_device_chunks - trace.state_bytes
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(FED_BYTES)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env=child_env(onednn=False))
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    return out


def test_the_premise_tensorflow_copies_an_unaligned_feed_into_the_device(runs):
    (aligned_value, aligned), (unaligned_value, unaligned) = \
        runs["plain_aligned"], runs["plain_unaligned"]
    assert aligned_value == unaligned_value
    assert unaligned >= aligned + FED_BYTES


def test_partitions_fed_an_unaligned_array_hold_no_copy_of_it(runs):
    """Every partition reads the fed array (a copy each, were it fed as given); the step's
    peak is what the simulator predicts, in TensorFlow's own figure."""
    value, measured = runs["tfmem_unaligned"]
    assert runs["partitions"] >= 3
    assert value == runs["plain_aligned"][0]
    assert abs(measured - runs["predicted_chunks"]) <= 0.02 * runs["predicted_chunks"], runs


def test_aligned_feed_copies_only_what_is_off_the_boundary():
    raw = np.arange(1024, dtype=np.float32)
    start = (-raw.ctypes.data // 4) % (ALIGNMENT // 4)
    aligned = raw[start:start + 512]
    assert aligned_feed(aligned) is aligned
    off = raw[start + 1:start + 513]
    copy = aligned_feed(off)
    assert copy.ctypes.data % ALIGNMENT == 0
    np.testing.assert_array_equal(copy, off)
    words = np.array([b"a", b"bc"], dtype=object)
    assert aligned_feed(words) is words
