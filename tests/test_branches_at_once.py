"""Independent branches of a partition run at once on two inter-op threads.

A gradient that reaches two batch normalizations makes both branches ready: one
thread keeps one branch, the other thread takes the other, and both branches'
intermediates are alive together.  The simulator's one-thread orders walk one
branch after the other and predict about half of that; with two threads it also
emulates two threads taking turns (tfmem.memory.op_order).

One fresh process per kernel path, two inter-op threads, one intra-op thread, a
BFC allocator far above the step: tfmem.function's prediction for one partition
of two branches is set against TensorFlow's peak of the same steps.
"""

import pytest

from conftest import run_worker
from tfmem.cli import child_env

MIB = 1 << 20

SCRIPT = r"""
import json, statistics
import numpy as np
import tensorflow as tf
import tfmem
from tfmem.run.placement import accelerator

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

def branches(x):
    # each branch holds three tensors of x's size at once (a, b, and their product)
    sums = []
    for first, second in ((tf.sin, tf.cos), (tf.cos, tf.sin)):
        a = first(x)
        b = second(a)
        sums.append(tf.reduce_sum(a * b + a))
    return sums[0] + sums[1]

x = tf.constant(np.random.default_rng(0).standard_normal(2 << 20).astype(np.float32))
step = tfmem.function(branches, partition_size=1000)
peaks = []
for _ in range(6):
    resident = accelerator.device_memory("CPU:0")["current"]
    accelerator.reset_peak("CPU:0")
    step(x).numpy()
    peaks.append(accelerator.device_memory("CPU:0")["peak"] - resident)
report = step.memory_report()
figures = dict(measured=max(peaks[1:]), predicted=report.predicted_device_peak,
               partitions=len(step.plan(x).partitions))
print("TFMEM-RESULTS " + json.dumps(figures))
"""


@pytest.mark.parametrize("onednn", [False, True])
def test_two_threads_running_two_branches_stay_within_the_prediction(onednn):
    figures = run_worker(SCRIPT, child_env.child_env(onednn=onednn), timeout=300)
    print(f"\nmeasured {figures['measured'] / MIB:.1f} MiB, "
          f"predicted {figures['predicted'] / MIB:.1f} MiB")
    assert figures["partitions"] == 1
    assert figures["measured"] <= figures["predicted"]
