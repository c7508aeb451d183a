"""Measuring a step without taking TensorFlow's figures from the user, and budget mode
learning from what it measured.

Both run in one fresh process with a BFC allocator capped far above the steps
(the cap is read when TensorFlow starts), oneDNN off, pinned thread pools;
it prints one JSON line with every figure.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfmem.memory.budget import DEFAULT_MARGIN

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MIB = 512
# Over the ResNet step's measured peak (~61-65 MiB), under it / (1 - margin).
LEARN_BUDGET_MIB = 64

SCRIPT = r"""
import json, logging, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import tensorflow as tf
from tfmem.run.placement import accelerator
from tfmem.cli import models
from tfmem.memory import scratch
tf1 = tf.compat.v1
budget_mib, cache_path = int(sys.argv[2]), sys.argv[3]
config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
out = {}

# 1. The user's own peak figure survives tfmem's steps.
model = models.mlp(layers=4)
sess = tf1.Session(graph=model.graph, config=config)
with model.graph.as_default():
    big = tf.reduce_sum(tf.random.uniform([24 << 18], seed=1))  # a 24 MiB tensor
tfs = tfmem.TFMemSession(sess, partition_size=10)
tfs.run(model.init)
accelerator.reset_peak("CPU:0")
sess.run(big)
out["user_peak"] = accelerator.device_memory("CPU:0")["peak"]
out["tfmem_peaks"] = []
for _ in range(3):
    tfs.run([model.train, model.loss], model.feed(256))
    out["tfmem_peaks"].append(tfs.last_step.device_peak_bytes)
out["partition_peaks"] = list(tfs.last_step.partition_peak_bytes)
out["partitions"] = tfs.last_step.partitions
out["peak_after"] = accelerator.device_memory("CPU:0")["peak"]
tfs.close()

# 2. Budget mode learns.  A stale kernel scratch cache (every kernel recorded with no
# scratch, as a cache from another machine might say) makes the first plan too large.
model = models.resnet(blocks=(2, 2, 2))
feed = model.feed(32)
fetches = [model.train, model.loss]
plain = tf1.Session(graph=model.graph, config=config)
plain_tfs = tfmem.TFMemSession(plain, partition_size=100000)  # init without cached constants
plain_tfs.run(model.init)
out["plain_losses"] = [float(plain.run(fetches, feed)[1]) for _ in range(3)]
plain.close()
sess = tf1.Session(graph=model.graph, config=config)
tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
probe = tfmem.TFMemSession(sess, partition_size=100000)
plan = probe.plan(fetches, feed)
scratch.write_stale_cache(cache_path, model.graph, plan.view,
                          {t.name: v.shape for t, v in feed.items()}, sess)
os.environ[scratch.CACHE_ENV] = cache_path
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)
tfs = tfmem.TFMemSession(sess, device_memory_budget=f"{budget_mib}MiB")
learn = out["learn"] = {"losses": [], "peaks": [], "partitions": [], "predicted": []}
for _ in range(3):
    accelerator.reset_peak("CPU:0")
    _, loss = tfs.run(fetches, feed)
    learn["losses"].append(float(loss))
    learn["peaks"].append(accelerator.device_memory("CPU:0")["peak"])
    learn["partitions"].append(tfs.last_step.partitions)
    learn["predicted"].append(tfs.memory_report().predicted_device_peak)
learn["log"] = list(records)

# 3. Sampled measurement: the first steps of a plan, then one in SAMPLE_EVERY; a step
# the user traces is measured anyway; a sampled step over the prediction still teaches.
from tensorflow.core.protobuf import config_pb2
from tfmem.run.measuring import sampling
model = models.mlp(layers=4)
sess = tf1.Session(graph=model.graph, config=config)
tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
feed, fetches = model.feed(256), [model.train, model.loss]
sampled = out["sampled"] = {}
from tfmem import tf_private
made = []  # the session callables TensorFlow builds (each from the whole session graph)
make_callable = tf_private.make_callable
tf_private.make_callable = lambda *args: made.append(1) or make_callable(*args)
for mode in sampling.MODES:
    tfs = tfmem.TFMemSession(sess, partition_size=10, measure=mode)
    flags, reports = [], []
    made.clear()
    for _ in range(sampling.WARMUP_STEPS + sampling.SAMPLE_EVERY + 8):
        tfs.run(fetches, feed)
        if len(flags) == 0:
            built_in_first_step = len(made)
        flags.append(tfs.last_step.measured)
        assert (tfs.last_step.device_peak_bytes is None) != tfs.last_step.measured
        report = tfs.memory_report()
        reports.append([report.step, report.measured_step, report.device_peak])
    traced = tf1.RunOptions(trace_level=tf1.RunOptions.SOFTWARE_TRACE)
    tfs.run(fetches, feed, options=traced, run_metadata=tf1.RunMetadata())
    sampled[mode] = dict(flags=flags, reports=reports, traced=tfs.last_step.measured,
                         built_in_first_step=built_in_first_step)
# Budget mode, figures stable and sampled: shrink the plan's prediction as a model that
# went stale would, and the next sampled step must re-plan (and measure every step again).
# A budget below the device: its ceiling is the in-use figure a measured step reads (on
# the whole device a step that ran teaches only new kernel scratch, see budget.Correction).
tfs = tfmem.TFMemSession(sess, device_memory_budget="256MiB")
steps, flags = 0, []
while True:
    tfs.run(fetches, feed)
    steps += 1
    entry = tfs._last_entry
    if entry.schedule.stable and not entry.schedule.wants():
        break
import dataclasses
entry.trace = dataclasses.replace(entry.trace, partitions=[
    dataclasses.replace(p, device_peak=1) for p in entry.trace.partitions])
records.clear()
for _ in range(sampling.SAMPLE_EVERY + 3):
    tfs.run(fetches, feed)
    flags.append(tfs.last_step.measured)
out["stale"] = dict(flags=flags, log=list(records), steps_to_stable=steps)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cache = tmp_path_factory.mktemp("scratch") / "kernels.json"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CAP_MIB), str(LEARN_BUDGET_MIB), str(cache)],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    learn = out["learn"]
    print(f"\nlearning: peaks {[round(p / MIB, 1) for p in learn['peaks']]} MiB, predicted "
          f"{[round(p / MIB, 1) for p in learn['predicted']]} MiB, partitions "
          f"{learn['partitions']}; log: {learn['log']}")
    return out


@pytest.mark.slow
def test_tfmem_leaves_tensorflows_peak_figure_alone(measured):
    """The user's process peak (a 24 MiB tensor) is still TensorFlow's peak after tfmem's
    steps, which measure their own, smaller peaks."""
    assert measured["peak_after"] == measured["user_peak"]
    assert measured["user_peak"] >= 24 * MIB
    assert measured["partitions"] > 1
    for peak in measured["tfmem_peaks"]:
        assert 0 < peak < measured["user_peak"]
    assert max(measured["partition_peaks"]) == measured["tfmem_peaks"][-1]


@pytest.mark.slow
def test_budget_mode_learns_from_a_step_over_its_prediction(measured):
    learn = measured["learn"]
    budget = LEARN_BUDGET_MIB * MIB
    # The stale cache's plan: one partition predicted without scratch, measured over it.
    assert learn["partitions"][0] == 1
    assert learn["peaks"][0] > learn["predicted"][0]
    assert any("planning the request again" in line for line in learn["log"]), learn["log"]
    # Re-planned for the next step: more partitions, inside the budget, predicted closer.
    assert learn["partitions"][1] > 1 and learn["partitions"][2] == learn["partitions"][1]
    assert max(learn["peaks"][1:]) <= budget, learn["peaks"]
    # The corrected prediction is budget mode's bound (device copies held to the end of
    # each partition, a chunk allowance): the later steps measure under it, within the
    # margin, and it lies closer to what they measure than the stale one did.  How tight
    # the bound is varies with the executor's op order (here 44.6-50.1 MiB measured
    # against 55.6, and in CI 46.3 against 58.3 after learning a factor over 1), so it is
    # not asserted here.
    assert max(learn["peaks"][1:]) <= learn["predicted"][2] / (1 - DEFAULT_MARGIN), learn
    assert (abs(learn["predicted"][2] - learn["peaks"][2])
            < abs(learn["predicted"][0] - learn["peaks"][0])), learn
    # No step ran twice: the losses are plain TensorFlow's three steps.
    np.testing.assert_allclose(learn["losses"], measured["plain_losses"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_sampled_measurement_measures_warmup_then_one_step_in_fifty(measured):
    from tfmem.run.measuring import sampling
    sampled = measured["sampled"]
    every, off, sample = sampled["every"], sampled["off"], sampled["sample"]
    assert all(every["flags"]) and every["traced"]
    assert not any(off["flags"]) and off["traced"]  # the user's traced step is measured
    flags = sample["flags"]
    warmup = flags.index(False)
    assert warmup >= sampling.WARMUP_STEPS and all(flags[:warmup]), flags
    # then exactly one measured step in SAMPLE_EVERY
    assert [i for i, f in enumerate(flags[warmup:]) if f] == [sampling.SAMPLE_EVERY - 1], flags
    assert sample["traced"]
    for (step, measured_step, peak), was_measured in zip(sample["reports"], flags):
        assert measured_step is not None and peak > 0
        assert (measured_step == step) == was_measured
    assert all(r[1] is None and r[2] is None for r in off["reports"])
    # A plan's first step builds the callables it runs, once: measured ones, or with
    # measuring off unmeasured ones (not measured ones it never runs, then the others)
    built = [sampled[m]["built_in_first_step"] for m in ("sample", "every", "off")]
    assert built[0] == built[1] == built[2] > 0, sampled


@pytest.mark.slow
def test_a_sampled_step_over_its_prediction_still_replans(measured):
    from tfmem.run.measuring import sampling
    stale = measured["stale"]
    flags = stale["flags"]
    first = flags.index(True)  # the next sampled step
    assert 0 < first < sampling.SAMPLE_EVERY, flags
    assert any("planning the request again" in line for line in stale["log"]), stale["log"]
    assert all(flags[first:first + 3]), flags  # a re-planned request is measured again


@pytest.mark.parametrize("bad", ["sometimes", None, 50, "Every"])
def test_measure_mode_is_checked(bad):
    import tensorflow as tf
    import tfmem
    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0)
    with tf.compat.v1.Session(graph=graph) as sess:
        with pytest.raises(ValueError, match="measure must be one of 'sample', 'every', 'off'"):
            tfmem.TFMemSession(sess, options=tfmem.Options(measure=bad))
