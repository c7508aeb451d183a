"""tfmem.function's budget mode learns from its measured steps, and stays within budget.

One fresh process with a BFC allocator capped far above the steps (512 MiB: a
step over its budget is seen, not stopped), oneDNN off, pinned thread pools;
it prints one JSON line.

(a) A stale kernel scratch cache (every kernel of a small Keras ResNet recorded
    with no scratch, as a cache written on another machine might say) makes the
    first plan one partition predicted far below what its convolution gradients
    allocate.  The first step goes over; budget mode must correct its model,
    plan again for the next step, and stay within the budget from then on,
    with tf.function's losses.
(b) The suite's TF2 models (an MLP, a convnet, a Keras ResNet) in budget mode
    at a budget well under their plain peak: no step over the budget.  The budget
    is what the device holds when the wrapped run starts plus a fraction of what
    the plain step took above what the device held: the bytes held vary by a MiB
    from process to process (TensorFlow's first update copies some variables), a
    fifth of the MLP's whole step.
(c) (a)'s stale cache again, under a 96 MiB peak the user made and did not reset:
    with Options(profile_peaks=True) budget mode still measures the step that went over,
    and learns.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAP_MIB = 512
# The ResNet of (a) at batch 32 measures ~67 MiB as one partition; its stale
# prediction (no scratch) is ~38 MiB, which fits 64 MiB less the 10 % margin.
LEARN_BUDGET_MIB = 64
STEPS = 4
# (b): each model's budget, what the device holds plus a fraction of the plain step's bytes
# above what it held.  With oneDNN off a convolution gradient kernel allocates a 32 MiB
# buffer whatever its shapes, a floor no partitioning lowers: the convnets' fractions
# leave room above it (plans of ~38 MiB are predicted).
FRACTIONS = dict(mlp=0.7, convnet=0.8, keras=0.85)

SCRIPT = r"""
import gc, json, logging, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
import keras
from tfmem.cli.tf2_models import build_convnet, build_mlp, build_resnet, make_step
from tfmem.run.placement import accelerator
from tfmem.memory import scratch
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
budget_mib, steps, cache_path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[5]
fractions = json.loads(sys.argv[4])
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)


def peak_of(fn, *args):
    accelerator.reset_peak("CPU:0")
    value = float(fn(*args))
    return value, accelerator.device_memory("CPU:0")["peak"]


def in_use():
    return accelerator.device_memory("CPU:0")["current"]


def resnet(seed, blocks=(2, 2, 2), batch=32):
    model = build_resnet(keras, blocks, width=16, seed=seed)
    r = np.random.default_rng(2)
    x = tf.constant(r.standard_normal((batch, 32, 32, 3)).astype(np.float32))
    y = tf.constant(r.integers(0, 10, batch).astype(np.int32))
    return make_step(tf, keras, model), (x, y)


def mlp(seed):
    step, x = build_mlp(tf, np, seed)
    return step, (x,)


def convnet(seed):
    step, _, args = build_convnet(tf, np, seed)
    return step, args


out = {}
# (b) Never over the budget: each model's budget a fraction of its plain peak.
bounded = out["bounded"] = {}
for name, build in dict(mlp=mlp, convnet=convnet, keras=resnet).items():
    fn, args = build(0)
    plain = tf.function(fn)
    plain_held = in_use()
    plain_runs = [peak_of(plain, *args) for _ in range(steps)]
    plain_step = max(p for _, p in plain_runs) - plain_held
    fn, args = build(0)
    budget = in_use() + int(fractions[name] * plain_step)
    wrapped = tfmem.function(fn, device_memory_budget=budget)
    records.clear()
    runs = [peak_of(wrapped, *args) for _ in range(steps)]
    bounded[name] = dict(budget=budget, plain_losses=[l for l, _ in plain_runs],
                         plain_peak=max(p for _, p in plain_runs),
                         losses=[l for l, _ in runs], peaks=[p for _, p in runs],
                         partitions=wrapped.last_step.partitions,
                         learned=[r for r in records if "again" in r])
    del fn, args, plain, wrapped
    gc.collect()
# (a) Learning.  The stale cache: the kernels of the step's trace, each recorded with no
# scratch; the process's scratch cache is that file from here on.
fn, args = resnet(0)
probe = tfmem.function(fn, partition_size=100000)
view = probe.plan(*args).view
scratch.calibrate(probe.get_concrete_function(*args).graph, view, {}, None,
                  cache=scratch.ScratchCache(cache_path + ".true"))
with open(cache_path + ".true") as file:
    zeros = {key: 0 for key in json.load(file)}
with open(cache_path, "w") as file:
    json.dump(zeros, file)
os.environ[scratch.CACHE_ENV] = cache_path


def drawing(fn):
    # The step, also returning a draw of a seeded random op (its stream must continue
    # when a re-plan compiles new partitions, as tf.function's one trace continues it).
    def step(x, y):
        return fn(x, y), tf.random.uniform([4], seed=7)
    return step


fn, args = resnet(1)
learner = tfmem.function(drawing(fn), device_memory_budget=f"{budget_mib}MiB")
learn = out["learn"] = dict(losses=[], peaks=[], partitions=[], predicted=[], measured=[],
                            draws=[])
records.clear()
for _ in range(steps):
    accelerator.reset_peak("CPU:0")
    loss, draw = learner(*args)
    learn["losses"].append(float(loss))
    learn["draws"].append(draw.numpy().tolist())
    learn["peaks"].append(accelerator.device_memory("CPU:0")["peak"])
    learn["partitions"].append(learner.last_step.partitions)
    learn["measured"].append(learner.last_step.device_peak_bytes)
    learn["predicted"].append(learner.memory_report().predicted_device_peak)
learn["log"] = list(records)
fn, args = resnet(1)
plain = tf.function(drawing(fn))
plain_runs = [plain(*args) for _ in range(steps)]
learn["plain_losses"] = [float(loss) for loss, _ in plain_runs]
learn["plain_draws"] = [draw.numpy().tolist() for _, draw in plain_runs]
# (c) The same stale cache, under a higher peak the user made and did not reset: the
# process peak tells nothing then; profile_peaks=True measures every partition anyway.
# (a) wrote the figures it measured again back to its file, so (c) gets a stale file of
# its own.
with open(cache_path + ".c", "w") as file:
    json.dump(zeros, file)
os.environ[scratch.CACHE_ENV] = cache_path + ".c"
fn, args = resnet(1)
big = tf.reduce_sum(tf.random.uniform([96 << 18], seed=1))  # 96 MiB, above the steps
del big
under = out["under_user_peak"] = dict(user_peak=accelerator.device_memory("CPU:0")["peak"],
                                      partitions=[], measured=[])
profiled = tfmem.function(fn, device_memory_budget=f"{budget_mib}MiB",
                          options=tfmem.Options(profile_peaks=True))
records.clear()
for _ in range(3):
    profiled(*args)
    under["partitions"].append(profiled.last_step.partitions)
    under["measured"].append(profiled.last_step.device_peak_bytes)
under["peak_after"] = accelerator.device_memory("CPU:0")["peak"]
under["log"] = list(records)
del os.environ[scratch.CACHE_ENV]

print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    cache = tmp_path_factory.mktemp("scratch") / "kernels.json"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CAP_MIB), str(LEARN_BUDGET_MIB), str(STEPS),
         json.dumps(FRACTIONS), str(cache)],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, f"process failed:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    learn = out["learn"]
    print(f"\nlearning: peaks {[round(p / MIB, 1) for p in learn['peaks']]} MiB, predicted "
          f"{[round(p / MIB, 1) for p in learn['predicted']]} MiB, partitions "
          f"{learn['partitions']}; log: {learn['log']}")
    for name, run in out["bounded"].items():
        print(f"{name}: budget {run['budget'] / MIB:.1f} MiB (plain {run['plain_peak'] / MIB:.1f}),"
              f" peaks {[round(p / MIB, 1) for p in run['peaks']]} MiB, {run['partitions']} "
              f"partitions, learned: {run['learned']}")
    return out


@pytest.mark.slow
def test_budget_mode_learns_from_a_step_over_its_prediction(measured):
    learn = measured["learn"]
    budget = LEARN_BUDGET_MIB * MIB
    # The stale cache's plan: one partition predicted without scratch, measured over it
    # (and over the budget: the stale model is what made that plan).
    assert learn["partitions"][0] == 1
    assert learn["measured"][0] == learn["peaks"][0] > learn["predicted"][0]
    assert learn["peaks"][0] > budget
    assert any("planning" in line and "again for the next step" in line
               for line in learn["log"]), learn["log"]
    # Planned again for the next step: more partitions, and within the budget from then on.
    assert all(p > 1 for p in learn["partitions"][1:]), learn["partitions"]
    assert max(learn["peaks"][1:]) <= budget, learn["peaks"]
    # No step ran twice: the losses are tf.function's steps (one intra-op thread).
    np.testing.assert_allclose(learn["losses"], learn["plain_losses"], rtol=1e-6)
    # The re-plan compiled new partitions, but the seeded random op runs in a function of
    # its own shared by every plan of the trace (tfmem.tf2.streams): its stream continues,
    # as tf.function's (a new plan's own copy of the op would start again from its seed).
    assert learn["plain_draws"][0] != learn["plain_draws"][1]
    assert learn["draws"] == learn["plain_draws"]
    assert not any("stream" in line for line in learn["log"]), learn["log"]


@pytest.mark.parametrize("model", ["mlp", "convnet", "keras"])
@pytest.mark.slow
def test_budget_mode_stays_within_its_budget(measured, model):
    run = measured["bounded"][model]
    assert run["partitions"] > 1  # the budget made it partition
    assert max(run["peaks"]) <= run["budget"], run
    np.testing.assert_allclose(run["losses"], run["plain_losses"], rtol=1e-6)


def test_learning_uses_the_peaks_it_knows_and_only_what_went_over():
    """`learn_from_step`, which both front ends call: unknown partition peaks (None, as
    tfmem.function reports below the process peak) are left out, the known ones teach;
    a step within its prediction, or with no known peak, teaches nothing."""
    from tfmem.cli import models
    from tfmem.memory import budget, learning
    from tfmem.memory.shapes import resolve_shapes
    from tfmem.memory.sizing import Sizing
    from tfmem.plan.analyse import analyse
    from tfmem.plan.build import make_plan

    model = models.mlp(layers=4)
    feed = model.feed(64)
    view = analyse([model.loss], [model.train], list(feed))
    plan = make_plan(view, 10)
    sizing = Sizing(resolve_shapes(model.graph, view, {t.name: v.shape for t, v in feed.items()}),
                    {})
    trace = budget.predict(plan, sizing)
    count = len(trace.partitions)
    assert count > 2

    def predict(extra):
        return budget.predict(plan, sizing, extra)

    below = [p.device_peak for p in trace.partitions]
    unknown = [None] * count
    over = list(unknown)
    over[1] = int(trace.peak_device * 1.5)
    correction = budget.Correction()
    assert not learning.learn_from_step(correction, trace, None, None, {}, predict)
    assert not learning.learn_from_step(correction, trace, unknown, None, {}, predict)
    assert not learning.learn_from_step(correction, trace, below, None, {}, predict)
    assert correction.factor == 1.0
    # Scratch is asked for only once the step went over.
    asked = []
    assert learning.learn_from_step(correction, trace, over, None,
                                    lambda: asked.append(1) or {}, predict)
    assert asked == [1] and correction.factor >= 1.5  # on working sets, not state
    assert abs(budget.scaled(trace, correction.factor).peak_device - over[1]) <= count
    # Bytes the device held for others (resident beyond the plan's state) are taken off.
    fresh = budget.Correction()
    resident = trace.state_bytes + over[1] - trace.peak_device
    assert not learning.learn_from_step(fresh, trace, over, resident, {}, predict)


@pytest.mark.slow
def test_budget_mode_learns_under_a_users_higher_peak_with_profile_peaks(measured):
    """(c): every step stays under the user's 96 MiB peak, so the process peak says
    nothing; the profiler's figures show the first step over its prediction, and budget
    mode plans again for the next, the user's peak untouched."""
    under = measured["under_user_peak"]
    print(f"\nunder the user's peak: measured {[m and round(m / MIB, 1) for m in under['measured']]}"
          f" MiB, partitions {under['partitions']}; log: {under['log']}")
    assert under["peak_after"] == under["user_peak"] >= 96 * MIB
    assert None not in under["measured"]
    assert all(m < under["user_peak"] for m in under["measured"])
    assert under["measured"][0] > 0.9 * LEARN_BUDGET_MIB * MIB  # the stale plan went over
    assert any("planned again" in line for line in under["log"]), under["log"]
    assert under["partitions"][1] > under["partitions"][0]
