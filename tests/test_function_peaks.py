"""tfmem.function(options=tfmem.Options(profile_peaks=True)): every partition of every step gets its own
device peak, also under a higher peak the user made and did not reset, equal to
TensorFlow's own figure for that call; the user's peak and profiler sessions are
left alone (run metadata is not touched at all).

One fresh process per configuration: the Eigen kernels (oneDNN off) under the
emulated cap (a BFC allocator), and oneDNN on (its own CPU allocator keeps
figures, no cap).  Pinned thread pools; each prints one JSON line.
"""

import json
import os
import subprocess
import sys

import pytest

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import dataclasses, json, os, sys, tempfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
if sys.argv[1] != "0":
    tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
from tfmem.run.placement import accelerator
from tfmem.cli.tf2_models import build_mlp
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
memory = lambda: accelerator.device_memory("CPU:0")
out = {"capped": sys.argv[1] != "0"}

fn, x = build_mlp(tf, np, 0)
profiled = tfmem.function(fn, partition_size=20, options=tfmem.Options(profile_peaks=True))
plain_fn, _ = build_mlp(tf, np, 0)
unprofiled = tfmem.function(plain_fn, partition_size=20)
for _ in range(2):
    profiled(x), unprofiled(x)

# The user's peak: a 48 MiB tensor, far above the steps, never reset.
big = tf.reduce_sum(tf.random.uniform([48 << 18], seed=1))
del big
out["user_peak"] = memory()["peak"]
out["steady"], out["unprofiled"] = [], []
for _ in range(3):
    profiled(x)
    out["steady"].append(dict(peak=profiled.last_step.device_peak_bytes,
                              partition_peaks=list(profiled.last_step.partition_peak_bytes),
                              partitions=profiled.last_step.partitions,
                              swapped=profiled.last_step.swapped_out_bytes,
                              report_peaks=list(profiled.memory_report().partition_peaks)))
    unprofiled(x)
    out["unprofiled"].append(list(unprofiled.last_step.partition_peak_bytes))
out["peak_after"] = memory()["peak"]

# The user's own profiler session runs through a step untouched (tfmem's cannot start
# then: that step falls back to the process peak, which the user's 48 MiB still holds),
# and sees the step's ops.
logdir = tempfile.mkdtemp()
tf.profiler.experimental.start(logdir)
profiled(x)
out["under_user_profiler"] = list(profiled.last_step.partition_peak_bytes)
tf.profiler.experimental.stop()
written = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs if f.endswith(".pb")]
out["user_profile_has_partitions"] = any(
    b"tfmem_partition_" in open(path, "rb").read() for path in written)
# TensorFlow's own figure for each call: this test (not tfmem) resets the peak before
# each partition call and reads it after.
executor, = {t.executor for t in profiled._traced.values()}  # pylint: disable=protected-access
originals = list(executor.functions)
tf_figures = []
def reset_around(call):
    def wrapped(*args):
        accelerator.reset_peak("CPU:0")
        values = call(*args)
        tf_figures.append(memory()["peak"])
        return values
    return wrapped
executor.functions[:] = [dataclasses.replace(f, call=reset_around(f.call)) for f in originals]
out["checked"] = []
for _ in range(2):
    tf_figures.clear()
    profiled(x)
    out["checked"].append(dict(tfmem=list(profiled.last_step.partition_peak_bytes),
                               tf=list(tf_figures)))
executor.functions[:] = originals

# Once the user's session has stopped, tfmem's starts again: measured under a high peak.
big = tf.reduce_sum(tf.random.uniform([48 << 18], seed=1))
del big
profiled(x)
out["after_profiler_peaks"] = list(profiled.last_step.partition_peak_bytes)
print(json.dumps(out))
"""

CONFIGURATIONS = {"eigen_capped": ("0", "512"), "onednn": ("1", "0")}


@pytest.fixture(scope="module", params=sorted(CONFIGURATIONS))
def measured(request):
    onednn, cap = CONFIGURATIONS[request.param]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, cap], capture_output=True, text=True, cwd=ROOT,
        timeout=900, env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("\n" + json.dumps(out, indent=1))
    return out


@pytest.mark.slow
def test_every_partition_of_a_steady_step_gets_its_peak(measured):
    """Under the user's higher peak, without a reset: a figure for every partition of
    every step (where the process-peak reader gets None), and the user's peak is intact."""
    assert measured["user_peak"] >= 48 * MIB
    assert measured["peak_after"] == measured["user_peak"]
    for step, unprofiled in zip(measured["steady"], measured["unprofiled"]):
        assert step["partitions"] > 1
        # Under the cap tensors are swapped (the prefetcher's uploads run beside the calls);
        # without one the "device" is host memory and nothing is.
        assert (step["swapped"] > 0) == measured["capped"]
        peaks = step["partition_peaks"]
        assert len(peaks) == step["partitions"] and None not in peaks, step
        assert all(0 < p < measured["user_peak"] for p in peaks), step
        assert step["peak"] == max(peaks)
        assert step["report_peaks"] == peaks
        assert unprofiled == [None] * len(unprofiled)  # the gap profile_peaks closes


@pytest.mark.slow
def test_each_partition_peak_equals_tensorflows_figure_for_that_call(measured):
    for step in measured["checked"]:
        assert len(step["tf"]) == len(step["tfmem"]) > 1
        assert step["tfmem"] == step["tf"], step


@pytest.mark.slow
def test_a_users_profiler_session_is_left_alone(measured):
    assert measured["user_profile_has_partitions"]
    assert measured["under_user_profiler"] == [None] * len(measured["under_user_profiler"])
    assert None not in measured["after_profiler_peaks"]  # tfmem's profiler starts again
