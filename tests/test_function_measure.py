"""tfmem.function measures its steps from TensorFlow's own figures and leaves the user's
peak figure alone; memory_report() against TensorFlow's allocator.

One fresh process with a BFC allocator capped far above the steps (the cap is
read when TensorFlow starts), oneDNN off, pinned thread pools; it prints one
JSON line with every figure.
"""

import json
import os
import subprocess
import sys

import pytest

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MIB = 512

SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
from tfmem.run.placement import accelerator
from tfmem.cli.tf2_models import build_mlp
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

def mlp(seed):
    return build_mlp(tf, np, seed)[0]

x = tf.constant(np.random.default_rng(1).standard_normal((1024, 256)).astype(np.float32))
out = {}

# 1. Measured steps against TensorFlow's peak of a freshly reset step (the user resets).
step = tfmem.function(mlp(0), partition_size=20)
first = float(step(x))
out["first_peak"] = step.last_step.device_peak_bytes
out["first_tf_peak"] = accelerator.device_memory("CPU:0")["peak"]
reset = out["reset"] = []
for _ in range(3):
    accelerator.reset_peak("CPU:0")
    step(x)
    report = step.memory_report()
    reset.append(dict(tf_peak=accelerator.device_memory("CPU:0")["peak"],
                      peak=step.last_step.device_peak_bytes,
                      partition_peaks=list(step.last_step.partition_peak_bytes),
                      partitions=step.last_step.partitions,
                      swapped=step.last_step.swapped_out_bytes,
                      report=report.__dict__))
out["pool"] = step.host_buffers.capacity_bytes
# Steps without a reset: a figure only where the step raised the process peak.
unreset = out["unreset"] = []
for _ in range(4):
    before = accelerator.device_memory("CPU:0")["peak"]
    step(x)
    unreset.append(dict(before=before, after=accelerator.device_memory("CPU:0")["peak"],
                        peak=step.last_step.device_peak_bytes,
                        partition_peaks=list(step.last_step.partition_peak_bytes)))

# 2. The user's peak figure (a 48 MiB tensor made before) survives tfmem's steps.
accelerator.reset_peak("CPU:0")
big = tf.reduce_sum(tf.random.uniform([48 << 18], seed=1))
out["user_peak"] = accelerator.device_memory("CPU:0")["peak"]
other = tfmem.function(mlp(0), partition_size=20)
out["user_case_peaks"], out["user_case_bounds"] = [], []
for _ in range(3):
    other(x)
    out["user_case_peaks"].append(other.last_step.device_peak_bytes)
    report = other.memory_report()
    out["user_case_bounds"].append(report.device_peak_bounds + (report.device_resident,))
out["peak_after"] = accelerator.device_memory("CPU:0")["peak"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CAP_MIB)], capture_output=True, text=True,
        cwd=ROOT, timeout=900, env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print("\n" + json.dumps(out, indent=1))
    return out


@pytest.mark.slow
def test_the_users_peak_figure_survives_tfmem_function_steps(measured):
    """A 48 MiB tensor the user made sets TensorFlow's peak; tfmem's steps leave it, and
    report their own peak as unknown rather than the user's figure."""
    assert measured["user_peak"] >= 48 * MIB
    assert measured["peak_after"] == measured["user_peak"]
    assert measured["user_case_peaks"] == [None, None, None]


@pytest.mark.slow
def test_step_peak_is_tensorflows_peak_of_a_freshly_reset_step(measured):
    assert measured["first_peak"] == measured["first_tf_peak"]
    for step in measured["reset"]:
        assert step["partitions"] > 1 and step["swapped"] > 0
        assert step["peak"] == step["tf_peak"]
        known = [p for p in step["partition_peaks"] if p is not None]
        assert known and max(known) == step["peak"]
        assert len(step["partition_peaks"]) == step["partitions"]


@pytest.mark.slow
def test_a_step_below_the_process_peak_reports_unknown_not_a_wrong_figure(measured):
    """Without a reset, a step's figure is TensorFlow's new peak when it raised it, else
    None; never the figure of an earlier step."""
    for step in measured["unreset"]:
        if step["after"] > step["before"]:
            assert step["peak"] == step["after"], step
            assert max(p for p in step["partition_peaks"] if p is not None) == step["after"]
        else:
            assert step["peak"] is None, step
            assert step["partition_peaks"] == [None] * len(step["partition_peaks"]), step


@pytest.mark.slow
def test_memory_report_against_tensorflows_figures(measured):
    for step in measured["reset"]:
        report = step["report"]
        assert report["device_peak"] == step["tf_peak"]
        assert report["partition_peaks"] == step["partition_peaks"]
        assert len(report["predicted_partition_peaks"]) == step["partitions"]
        assert max(report["predicted_partition_peaks"]) == report["predicted_device_peak"]
        chunks = report["predicted_partition_peaks_chunks"]
        assert len(chunks) == len(report["partition_scratch"]) == step["partitions"]
        assert max(chunks) == report["predicted_device_peak_chunks"]
        # Swapped bytes are exact: the pool holds what was predicted and swapped.
        assert report["host_buffers"] == measured["pool"] == step["swapped"]
        assert report["predicted_host_peak"] == report["host_buffers"]
        # The prediction counts the step's tensors; the variables and the input were
        # resident.  Within 25 %: a fixed partition size's prediction (budget mode plans
        # with its own bound and learns; see test_function_learns.py).
        predicted = report["device_resident"] + report["predicted_device_peak"]
        assert abs(predicted - step["tf_peak"]) <= 0.25 * step["tf_peak"], (predicted, step)


@pytest.mark.slow
def test_memory_report_bounds_the_peak_where_it_is_unknown(measured):
    """Steps below the user's 48 MiB peak have no exact figure, but bounds: at least the
    bytes seen in use during the step, at most TensorFlow's process peak."""
    for step in measured["reset"]:  # a freshly reset step: the upper bound is its peak
        lower, upper = step["report"]["device_peak_bounds"]
        assert step["report"]["device_resident"] <= lower <= upper == step["tf_peak"]
    # What the same plan adds to the resident bytes at its peak (reset steps of an
    # identical function; the two functions' variables differ, so resident bytes do).
    same_plan = max(step["tf_peak"] - step["report"]["device_resident"]
                    for step in measured["reset"])
    for lower, upper, resident in measured["user_case_bounds"]:
        assert upper == measured["user_peak"]
        # Bytes really in use during the step: never above what the plan measured (1 MiB
        # of allocator slack between two processes' runs of the plan).
        assert resident <= lower <= resident + same_plan + MIB, (lower, resident, same_plan)
    print("lower bound over resident / measured:",
          [round((lower - resident) / same_plan, 2)
           for lower, _, resident in measured["user_case_bounds"]])


def test_memory_report_needs_a_step():
    import tensorflow as tf
    import tfmem

    step = tfmem.function(lambda x: x * 2.0, partition_size=5)
    with pytest.raises(RuntimeError, match="call the function first"):
        step.memory_report()
    step(tf.constant([1.0, 2.0]))
    report = step.memory_report()
    assert report.predicted_device_peak > 0 and report.host_buffers == 0
    assert report.predicted_device_peak_chunks >= report.predicted_device_peak
    # The text states the band (resident bytes added: the prediction counts the step's
    # own tensors) and has a row per partition.
    text = str(report).splitlines()
    resident = report.device_resident or 0
    assert f"{(report.predicted_device_peak + resident) / (1 << 20):.2f} MiB requested" \
        in text[0], text
    rows = [line for line in text if line[:5].strip().isdigit()]
    assert len(rows) == len(report.predicted_partition_peaks)


KERNEL_PATH_SCRIPT = r"""
import json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np
import tensorflow as tf
import tfmem
from tfmem.run.placement import accelerator
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
w = tf.Variable(np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32))

def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.relu(tf.nn.relu(x @ w) @ w))
    w.assign_sub(0.01 * tape.gradient(loss, w))
    return loss

x = tf.constant(np.ones((512, 256), np.float32))
wrapped = tfmem.function(step, partition_size=10)
out = dict(steps=[])
for _ in range(2):
    accelerator.reset_peak("CPU:0")  # a no-op where TensorFlow keeps no figures
    wrapped(x)
    out["steps"].append(dict(peak=wrapped.last_step.device_peak_bytes,
                             tf=accelerator.device_memory("CPU:0"),
                             partitions=list(wrapped.last_step.partition_peak_bytes or [])))
print(json.dumps(out))
"""


@pytest.mark.parametrize("env", [
    dict(TF_ENABLE_ONEDNN_OPTS="1"),
    dict(TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true"),
    dict(TF_ENABLE_ONEDNN_OPTS="0"),
], ids=["onednn-default-allocator", "bfc-without-cap", "default-allocator"])
@pytest.mark.slow
def test_a_figure_wherever_tensorflow_keeps_allocator_statistics(env):
    """No emulated cap: with oneDNN on (its CPU allocator keeps figures) or a BFC
    allocator without a limit, the step's peak is TensorFlow's; only TensorFlow's default
    CPU allocator with oneDNN off keeps none, and the peak is then None."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB")}
    done = subprocess.run([sys.executable, "-c", KERNEL_PATH_SCRIPT], capture_output=True,
                          text=True, cwd=ROOT, timeout=600, env=dict(clean, **env))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for step in out["steps"]:
        if step["tf"] is None:  # TensorFlow keeps no figures: neither does tfmem
            assert env == dict(TF_ENABLE_ONEDNN_OPTS="0")
            assert step["peak"] is None and step["partitions"] == []
        else:
            assert step["peak"] == step["tf"]["peak"] > 0, step
            assert max(p for p in step["partitions"] if p is not None) == step["peak"]
