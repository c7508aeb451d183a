"""Budget mode plans beside what the device holds for the program, not beside garbage.

A program that drops a function, a session or a failed step's traceback can leave
device tensors in a reference cycle until Python's cyclic collector runs; when that
is depends on the program's allocations.  A plan fitted beside such garbage would be
tighter than needed, or find that nothing fits, depending on when the collector last
ran.  In one capped process (oneDNN off, set explicitly) with the collector off, a
24 MiB device tensor sits in an unreachable cycle while a 64 MiB device is planned
for, through both front ends: each must plan as it does with no garbage at all, and
the garbage must be gone.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

SCRIPT = r"""
import gc, json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(64)
import numpy as np
import tensorflow as tf
from tfmem.cli import models
from tfmem.cli.tf2_models import build_mlp
from tfmem.run.placement import accelerator
tf1 = tf.compat.v1
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
gc.disable()  # garbage stays until something collects it


def garbage(mib):
    cycle = [tf.fill([mib << 18], 2.0)]  # made by a kernel: on the device
    cycle.append(cycle)


def in_use():
    return accelerator.device_memory("CPU:0")["current"]


def function(dirty):
    fn, x = build_mlp(tf, np, seed=0, layers=12)
    if dirty:
        garbage(24)
    before = in_use()
    partitioned = tfmem.function(fn, device_memory_budget="64MiB")
    partitioned(x)
    return partitioned.last_step.partitions, before - in_use()


def session(dirty):
    model = models.mlp(layers=12)
    config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    tfs = tfmem.TFMemSession(tf1.Session(graph=model.graph, config=config),
                             device_memory_budget="64MiB")
    tfs.run(model.init)
    if dirty:
        garbage(24)
    before = in_use()
    tfs.run([model.train, model.loss], model.feed(1024))
    partitions = tfs.last_step.partitions
    tfs.close()
    return partitions, before - in_use()


front_end = {"function": function, "session": session}[sys.argv[1]]
clean, _ = front_end(False)
gc.collect()
dirty, freed = front_end(True)
print(json.dumps(dict(clean=clean, dirty=dirty, freed=freed)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["function", "session"])
def test_budget_mode_plans_as_if_the_garbage_were_collected(front_end):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", SCRIPT, front_end], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["dirty"] == out["clean"], out
    assert out["freed"] >= 24 * MIB, out  # the garbage's tensor is gone
