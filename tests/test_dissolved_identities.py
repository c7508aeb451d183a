"""An IdentityN that Grappler removes does not hold its readers back.

Keras's optimizers pass a step's gradients through one IdentityN.  Grappler's
dependency optimizer removes it from every partition function that reads its
outputs itself, so each variable's update arithmetic runs as soon as its own
gradient is there, beside the long kernels of the last gradients: its results
(held to the partition's end) are alive at their peak.  An emulated executor
that waits for the IdentityN puts them all after that peak.

One fresh process per kernel path, two inter-op threads, one intra-op thread, a
BFC allocator far above the step: tfmem.function's prediction for one partition
is set against TensorFlow's peak of the same steps.
"""

import pytest
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from conftest import run_worker
from tfmem.cli import child_env
from tfmem.run.compiling import regrouping

MIB = 1 << 20

SCRIPT = r"""
import json
import numpy as np
import tensorflow as tf
import tfmem
from tfmem.memory import op_order
from tfmem.run.placement import accelerator

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(2)

def joined_then_small(m, v):
    # the long branch first: four 1024 x 1024 products, then a 32 MiB tile
    h = m
    for _ in range(4):
        h = tf.matmul(h, m)
    total = tf.reduce_sum(tf.tile(h, [8, 1]))
    # the long branch's result and forty inputs joined as Keras joins a step's gradients
    joined = tf.identity_n([total] + [v] * 40)
    # forty small results of 0.5 MiB each, returned: held to the end
    return total, [tf.sin(g + float(i)) for i, g in enumerate(joined[1:])]

rng = np.random.default_rng(0)
m = tf.constant(rng.standard_normal((1024, 1024)).astype(np.float32) / 32)
v = tf.constant(rng.standard_normal(1 << 17).astype(np.float32))
step = tfmem.function(joined_then_small, partition_size=1000)
peaks = []
for _ in range(5):
    resident = accelerator.device_memory("CPU:0")["current"]
    accelerator.reset_peak("CPU:0")
    total, smalls = step(m, v)
    total.numpy()
    del total, smalls
    peaks.append(accelerator.device_memory("CPU:0")["peak"] - resident)
report = step.memory_report()
plan = step.plan(m, v)
figures = dict(measured=max(peaks[1:]), predicted=report.predicted_device_peak,
               chunks=report.predicted_device_peak_chunks, partitions=len(plan.partitions),
               dissolved=sorted(op_order.dissolved_identities(plan.view,
                                                              plan.partitions[0].ops)))
print("TFMEM-RESULTS " + json.dumps(figures))
"""


@pytest.mark.parametrize("onednn", [False, True])
def test_readers_of_a_removed_identity_n_run_beside_a_long_kernel(onednn):
    figures = run_worker(SCRIPT, child_env.child_env(onednn=onednn), timeout=300)
    print(f"\nmeasured {figures['measured'] / MIB:.2f} MiB, predicted "
          f"{figures['predicted'] / MIB:.2f} MiB requested, {figures['chunks'] / MIB:.2f} "
          "in the allocator's chunks")
    assert figures["partitions"] == 1
    assert len(figures["dissolved"]) == 1
    # Grappler removed the IdentityN: the forty small results (20 MiB) were alive
    # beside the tile (32 MiB) and a product (4 MiB)
    assert figures["measured"] > 52 * MIB
    assert figures["measured"] <= figures["chunks"]


def _config(**rewrite):
    return config_pb2.ConfigProto(graph_options=config_pb2.GraphOptions(
        rewrite_options=rewriter_config_pb2.RewriterConfig(**rewrite)))


def test_identities_are_removed_where_the_dependency_optimizer_runs():
    off = rewriter_config_pb2.RewriterConfig.OFF
    assert regrouping.runs_dependency_optimizer(None)
    assert regrouping.runs_dependency_optimizer(_config())
    assert regrouping.runs_dependency_optimizer(_config(arithmetic_optimization=off))
    assert not regrouping.runs_dependency_optimizer(_config(dependency_optimization=off))
    assert not regrouping.runs_dependency_optimizer(_config(disable_meta_optimizer=True))
