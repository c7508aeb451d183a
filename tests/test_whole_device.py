"""Budget mode on the whole device, measured: a step whose in-use figure is the device.

On an accelerator that holds its memory as one region (a GPU; the emulated one
after `reserve_emulated_memory`), a request larger than half of the region's free
tail gets the whole tail (BFC does not split it), so TensorFlow's in-use figure
reaches the device while every request is served.  Budget mode with the whole
device as its budget must plan such a step as plain TensorFlow runs it (one
partition), where a ceiling on the in-use figure would have refused it.

In a capped process (the cap must differ from this one's): a convolution's filter
gradient, whose Eigen kernel asks for 23.6 MiB of scratch (the im2col patches), beside
16 MiB of other state, so that the scratch takes the region's ~40 MiB tail whole.
Eigen's path only (oneDNN's kernel needs no such buffer); both paths' models are
checked elsewhere (test_simulate).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
CAP_MIB = 64

SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import tensorflow as tf
tfmem.reserve_emulated_memory()
from tfmem.memory import emulated
from tfmem.run.placement import accelerator
tf1 = tf.compat.v1
MIB = 1 << 20
PINNED = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)


def build():
    graph = tf.Graph()
    with graph.as_default():
        tf1.set_random_seed(7)  # the same variables in every graph
        images = tf1.get_variable("images", [40, 16, 16, 64], use_resource=True)
        kernel = tf1.get_variable("kernel", [3, 3, 64, 64], use_resource=True)
        ballast = tf1.get_variable("ballast", [16 * MIB // 4], use_resource=True,
                                   initializer=tf1.ones_initializer())
        features = tf.nn.conv2d(images, kernel, 1, "SAME")
        gradient, = tf.gradients(tf.reduce_sum(features), [kernel])  # 23.6 MiB of scratch
        total = tf.add(tf.reduce_sum(gradient), tf.reduce_sum(ballast), name="total")
        init = tf1.global_variables_initializer()
    return graph, init, total


def run(kind):
    graph, init, total = build()
    sess = tf1.Session(graph=graph, config=PINNED)
    runner = sess if kind == "plain" else tfmem.TFMemSession(sess, partition_size="auto")
    runner.run(init)
    out = {"values": [], "peaks": []}
    for _ in range(2):
        accelerator.reset_peak("CPU:0")  # this process's own measurement
        try:
            out["values"].append(float(runner.run(total)))
        except tf.errors.ResourceExhaustedError as err:
            out["oom"] = str(err)[:300]
            break
        out["peaks"].append(accelerator.device_memory("CPU:0")["peak"])
    if kind == "tfmem":
        trace = runner.simulate(total)
        out.update(partitions=len(runner.plan(total).partitions),
                   requested=trace.peak_device_requested,
                   chunks=trace.peak_device_chunks, served=trace.served,
                   budget=runner.memory_report().device_budget)
    sess.close()
    return out


print(json.dumps({"reserved": emulated.allocator_regions().reserved,
                  "plain": run("plain"), "tfmem": run("tfmem")}))
"""


@pytest.fixture(scope="module")
def runs():
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(CAP_MIB)], capture_output=True,
                          text=True, cwd=ROOT, timeout=600,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    return out


def test_the_premise_plain_tensorflow_fills_the_device_and_runs(runs):
    plain = runs["plain"]
    assert runs["reserved"][-1] >= (CAP_MIB - 4) * MIB  # one region of nearly the cap
    assert "oom" not in plain, plain["oom"]
    assert min(plain["peaks"]) > 0.9 * CAP_MIB * MIB


def test_budget_mode_runs_the_step_whole_and_stays_on_the_device(runs):
    plain, ours = runs["plain"], runs["tfmem"]
    assert ours["budget"] == CAP_MIB * MIB
    assert "oom" not in ours, ours["oom"]
    assert ours["partitions"] == 1
    np.testing.assert_array_equal(ours["values"], plain["values"])
    assert max(ours["peaks"]) <= CAP_MIB * MIB
    # The replay sees the tail taken whole: an in-use ceiling would have refused it.
    assert ours["served"]
    assert ours["chunks"] > 0.9 * CAP_MIB * MIB >= ours["requested"]
