"""Budget mode learns on the partial-run path (tfmem.Options(partial_runs=True)).

A partial run has no step statistics, so its steps are measured by
TensorFlow's process figures around each partition's call (run/measuring/call_peaks.py):
a call that raised the process peak has that peak as its own, any other is
unknown (None).  The process peak is read, never reset.

Two fresh processes (oneDNN off, one intra-op and one inter-op thread).  The
first, on an uncapped BFC allocator, measures a plain step of a small ResNet (14 layers).
The second runs on the same allocator with a budget a little above that peak
(below the device's memory: a ceiling on the allocator's in-use figure, which a
budget of the whole device is not, see budget) and a stale kernel scratch
cache (every kernel recorded with no scratch, as a file from another machine
might say; with oneDNN off the convolution gradients allocate megabytes of
im2col scratch).  Its first plan, one partition, is predicted under the budget
without that scratch; the step measures over it as a partial run, learns, logs,
and the next step runs a new plan, still as a partial run, under the budget.  The
losses and weights equal a plain Session.run's of the same steps, bit for bit.
TensorFlow's process peak never goes down across tfmem's steps; the re-planned
steps, under the first one's peak, read None for every call; after the user
resets the peak, the calls that raise it again are known and the others None.
"""

import json
import math
import os
import subprocess
import sys

import pytest

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 32
STEPS = 4
CAP_MIB = 4096  # far above every step: a BFC allocator with its figures

SCRIPT = r"""
import json, logging, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
from tfmem.cli import models
from tfmem.memory import scratch
from tfmem.run.placement import accelerator
tf1 = tf.compat.v1
stage, batch, steps, cache_path = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
budget_mib = int(sys.argv[6])
model = models.resnet(blocks=(2, 2, 2))
config = tfmem.session_config(tf1.ConfigProto(intra_op_parallelism_threads=1,
                                              inter_op_parallelism_threads=1))
feed = model.feed(batch)
fetches = [model.train, model.loss]
variables = model.graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)


def peak():
    return accelerator.device_memory("CPU:0")["peak"]


out = {}
if stage == "reference":  # the plain step's peak, uncapped (this process's own figure)
    plain = tf1.Session(graph=model.graph, config=config)
    plain.run(model.init)
    accelerator.reset_peak("CPU:0")
    plain.run(fetches, feed)
    out["plain_peak"] = peak()
    print(json.dumps(out))
    sys.exit(0)

sess = tf1.Session(graph=model.graph, config=config)
sess.run(model.init)
# A stale scratch cache: this request's kernels, each recorded with no scratch.
view = tfmem.TFMemSession(sess, partition_size=100000).plan(fetches, feed).view
scratch.write_stale_cache(cache_path, model.graph, view,
                          {t.name: v.shape for t, v in feed.items()}, sess)
os.environ[scratch.CACHE_ENV] = cache_path
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)

tfs = tfmem.TFMemSession(sess, device_memory_budget=f"{budget_mib}MiB",
                         options=tfmem.Options(partial_runs=True))
out["budget"] = tfs._budget
out["steps"] = []
for _ in range(steps):
    records.clear()
    before = peak()
    _, loss = tfs.run(fetches, feed)
    stats = tfs.last_step
    out["steps"].append(dict(
        loss=np.asarray(loss).tobytes().hex(), partial_run=stats.partial_run,
        measured=stats.measured, partitions=stats.partitions,
        partition_peaks=stats.partition_peak_bytes, step_peak=stats.device_peak_bytes,
        bounds=stats.device_peak_bounds, resident=stats.resident_bytes,
        predicted=tfs.memory_report().predicted_device_peak,
        process_peak_before=before, process_peak_after=peak(),
        learned=[r for r in records if "planning the request again" in r],
        replanned=[r for r in records if "planned again with the corrected model" in r]))
# The user resets the peak (theirs to reset): the calls that raise it again are known.
accelerator.reset_peak("CPU:0")
floor = peak()
tfs.run(fetches, feed)
stats = tfs.last_step
out["after_reset"] = dict(floor=floor, process_peak_after=peak(),
                          partition_peaks=stats.partition_peak_bytes,
                          step_peak=stats.device_peak_bytes)
out["weights"] = [v.tobytes().hex() for v in sess.run(variables)]
out["cache_after"] = dict(scratch.default_cache().items())
tfs.close()

plain = tf1.Session(graph=model.graph, config=config)  # the same steps, plain, after
plain.run(model.init)
out["plain_losses"] = [np.asarray(plain.run(fetches, feed)[1]).tobytes().hex()
                       for _ in range(steps + 1)]
out["plain_weights"] = [v.tobytes().hex() for v in plain.run(variables)]
out["budget_bytes"] = budget_mib << 20
out["final_peak"] = peak()
print(json.dumps(out))
"""


def _child(stage, cache_path, budget_mib=0):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFMEM_SCRATCH_CACHE", None)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(CAP_MIB), stage, str(BATCH),
                           str(STEPS), str(cache_path), str(budget_mib)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, f"{stage} process failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_budget_mode_learns_from_partial_run_steps(tmp_path):
    plain_peak = _child("reference", tmp_path / "unused.json")["plain_peak"]
    # A budget a little above the plain step: one partition fits it, not the budget less
    # the margin once the scratch is known.
    budget_mib = math.ceil(plain_peak * 1.06 / MIB)
    out = _child("learn", tmp_path / "kernels.json", budget_mib)
    steps = out["steps"]
    print(f"\nplain peak {plain_peak / MIB:.2f} MiB, budget {budget_mib} MiB")
    for number, step in enumerate(steps, 1):
        print(f"step {number}: {step['partitions']} partitions, partial run "
              f"{step['partial_run']}, peaks {step['partition_peaks']}, step peak "
              f"{step['step_peak']}, bounds {step['bounds']}, predicted {step['predicted']}, "
              f"process peak {step['process_peak_before']} -> {step['process_peak_after']}; "
              f"{step['learned'] + step['replanned']}")

    first, second = steps[0], steps[1]
    # (a) the first plan, predicted without the scratch, fits in one partition; its step
    # runs as a partial run, measures over the prediction, learns and says so
    assert first["partitions"] == 1 and first["partial_run"] and first["measured"]
    assert first["step_peak"] > first["predicted"], first
    assert first["learned"], first
    # ... and the next step runs a new plan, as a partial run
    assert second["partitions"] > 1 and second["partial_run"], second
    assert second["replanned"], second
    assert all(s["partial_run"] for s in steps)
    assert all(s["partitions"] == second["partitions"] for s in steps[1:])
    # the process never peaked above the budget
    assert out["final_peak"] <= out["budget_bytes"]
    # the kernels measured again replaced the stale figures (no longer all 0)
    assert any(out["cache_after"].values())
    # no step ran twice: losses and weights are plain TensorFlow's, bit for bit
    assert [s["loss"] for s in steps] == out["plain_losses"][:STEPS]
    assert out["weights"] == out["plain_weights"]

    # (b) TensorFlow's process peak is never reset by a tfmem step: it never goes down
    figures = [f for s in steps for f in (s["process_peak_before"], s["process_peak_after"])]
    assert figures == sorted(figures), figures
    # the first step raised it: its peak is TensorFlow's process peak after it
    assert first["step_peak"] == first["process_peak_after"] > first["process_peak_before"]

    # (c) a call that did not raise the process peak is unknown, not a number: the
    # re-planned steps stay under the first step's peak, so every call of theirs is None,
    # with bounds from TensorFlow's figures (at most the process peak)
    for step in steps[1:]:
        assert step["process_peak_after"] == step["process_peak_before"], step
        assert step["partition_peaks"] == [None] * step["partitions"], step
        assert step["step_peak"] is None and not step["measured"], step
        low, high = step["bounds"]
        assert step["resident"] <= low <= high == step["process_peak_before"], step

    # After the user reset the peak, the calls that raised it again are known: each known
    # one above every earlier one (it raised the process peak), the step's peak is the
    # process peak after it, and a call under an earlier call's peak stays None
    reset = out["after_reset"]
    print(f"after a reset: {reset}")
    known = [p for p in reset["partition_peaks"] if p is not None]
    assert known and known == sorted(set(known)), reset
    assert reset["step_peak"] == reset["process_peak_after"] >= known[-1] > reset["floor"]
    assert None in reset["partition_peaks"], reset
