"""Budget mode learns from a step that ran out of device memory.

A plan predicted to fit can still run out: its kernels' scratch calibrated wrong (a
stale `TFMEM_SCRATCH_CACHE` file from another machine), an executor order the model
did not take.  The step raises `DeviceMemoryError` (TensorFlow's step is not atomic: the
updates that ran before the failure stay, as they would in a plain `Session.run`); it
is never run again.  The next step would run the same plan and run out again, step
after step, so budget mode measures the request's kernels again, raises its
factor until the failed partition's prediction reaches what the device had for it,
says so in the error, and plans again before the next step.

The same for `tfmem.function` (a convolution net in eager TensorFlow), in a second
test.

Three fresh processes per test (oneDNN off, set explicitly: the Eigen convolution gradients
allocate megabytes of im2col scratch; one intra-op and one inter-op thread).  The
first measures a plain step of a small ResNet on an uncapped BFC allocator.  The
second runs on a device capped below that step and held as one region (as a GPU's
allocator holds its memory; grown regions leave no room for the 31 MiB scratch
request under such a cap), with a stale scratch file recording
no scratch for any kernel and the whole device as budget: the first plan is
predicted to fit without the scratch and runs out; the next steps run a new plan
within the cap.  The third, with a cap far above the step but also one region (the
allocator's layout moves the last bits of these kernels' results, in plain TensorFlow
too), runs the same steps in a plain `Session.run` from the weights the failed step
left: losses and weights are equal, bit for bit.
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
STEPS = 3
REFERENCE_CAP_MIB = 4096  # far above every step: a BFC allocator with its figures
CAP_FRACTION = 0.85  # of the plain step's peak: the step cannot fit as it is

SCRIPT = r"""
import json, logging, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
stage = sys.argv[2]
if stage != "reference":  # one region of the cap, as a GPU's allocator holds its memory
    tfmem.reserve_emulated_memory()  # (and the layout of both runs compared bit for bit)
from tfmem.cli import models
from tfmem.memory import scratch
from tfmem.run.placement import accelerator
tf1 = tf.compat.v1
batch, steps, cache_path = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
model = models.resnet(blocks=(2, 2, 2))
# tfmem's config on every session (Grappler off): with Grappler on, each partition is
# optimised on its own and the last bits of a step may differ from plain's.
config = tfmem.session_config(tf1.ConfigProto(intra_op_parallelism_threads=1,
                                              inter_op_parallelism_threads=1))
feed = model.feed(batch)
fetches = [model.train, model.loss]
variables = model.graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)

out = {}
if stage == "reference":  # the plain step's peak, uncapped (this process's own figure)
    plain = tf1.Session(graph=model.graph, config=config)
    plain.run(model.init)
    accelerator.reset_peak("CPU:0")
    plain.run(fetches, feed)
    out["plain_peak"] = accelerator.device_memory("CPU:0")["peak"]
    print(json.dumps(out))
    sys.exit(0)
left_path = cache_path + ".left.npz"  # the weights the failed step left
if stage == "plain":  # plain steps from those weights, uncapped
    plain = tf1.Session(graph=model.graph, config=config)
    plain.run(model.init)
    left = np.load(left_path)
    with model.graph.as_default():
        for number, variable in enumerate(variables):
            variable.load(left[str(number)], plain)
    out["losses"] = [np.asarray(plain.run(fetches, feed)[1]).tobytes().hex()
                     for _ in range(steps)]
    out["weights"] = [v.tobytes().hex() for v in plain.run(variables)]
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
tfs = tfmem.TFMemSession(sess, partition_size="auto")  # the whole device as budget
first_plan = tfs.plan(fetches, feed)
out["first_partitions"] = len(first_plan.partitions)
try:
    tfs.run(fetches, feed)
    out["error"] = None
except tfmem.DeviceMemoryError as err:
    out["error"] = "\n".join([str(err)] + list(getattr(err, "__notes__", ())))
np.savez(left_path, **{str(n): v for n, v in enumerate(sess.run(variables))})
out["steps"] = []
for _ in range(steps):
    records.clear()
    _, loss = tfs.run(fetches, feed)
    out["steps"].append(dict(loss=np.asarray(loss).tobytes().hex(),
                             partitions=tfs.last_step.partitions,
                             step_peak=tfs.last_step.device_peak_bytes,
                             predicted=tfs.memory_report().predicted_device_peak,
                             log=[r for r in records if "compiled" not in r],
                             peak=accelerator.device_memory("CPU:0")["peak"]))
out["weights"] = [v.tobytes().hex() for v in sess.run(variables)]
tfs.close()
print(json.dumps(out))
"""


def _child(script, stage, cap_mib, *args):
    """The JSON line a fresh process running `script` prints (oneDNN off, no scratch file
    of the caller's)."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFMEM_SCRATCH_CACHE", None)
    done = subprocess.run([sys.executable, "-c", script, str(cap_mib), stage,
                           *(str(a) for a in args)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert done.returncode == 0, f"{stage} process failed:\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _runs(script, tmp_path, *args):
    """(plain's peak, the cap, the learning run, plain's run from the weights it left): the
    cap is CAP_FRACTION of plain's uncapped peak, so the stale first plan runs out."""
    def child(stage, cap_mib, cache_path):
        return _child(script, stage, cap_mib, *args, cache_path)

    plain_peak = child("reference", REFERENCE_CAP_MIB, tmp_path / "unused.json")["plain_peak"]
    cap_mib = math.floor(plain_peak * CAP_FRACTION / MIB)
    out = child("learn", cap_mib, tmp_path / "kernels.json")
    plain = child("plain", REFERENCE_CAP_MIB, tmp_path / "kernels.json")
    return plain_peak, cap_mib, out, plain


@pytest.mark.slow
def test_budget_mode_plans_again_after_a_step_runs_out_of_device_memory(tmp_path):
    plain_peak, cap_mib, out, plain = _runs(SCRIPT, tmp_path, BATCH, STEPS)
    print(f"\nplain peak {plain_peak / MIB:.2f} MiB, cap {cap_mib} MiB; first plan "
          f"{out['first_partitions']} partitions; {out['error']}")
    for number, step in enumerate(out["steps"], 2):
        print(f"step {number}: {step['partitions']} partitions, peak {step['step_peak']}, "
              f"predicted {step['predicted']}, process peak {step['peak'] / MIB:.2f} MiB; "
              f"{step['log']}")
    # the stale first plan ran out of device memory, and the error says what was learned
    assert out["error"] is not None, "the first step did not run out: the test proves nothing"
    assert "Budget mode took this in" in out["error"], out["error"]
    # the next steps run a new plan, within the device
    assert all(s["partitions"] > out["first_partitions"] for s in out["steps"]), out["steps"]
    assert len({s["partitions"] for s in out["steps"]}) == 1
    # ... and stays: on the whole device a step that ran teaches only new kernel scratch
    # (its in-use figure may be the whole device), so nothing is learned or planned again
    assert not [r for s in out["steps"][1:] for r in s["log"] if "again" in r], out["steps"]
    # no step ran twice: plain TensorFlow's losses and weights from what the failure left
    assert [s["loss"] for s in out["steps"]] == plain["losses"]
    assert out["weights"] == plain["weights"]


TF2_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import numpy as np
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
stage, steps, cache_path = sys.argv[2], int(sys.argv[3]), sys.argv[4]
if stage != "reference":  # one region of the cap (and the layout both runs share)
    tfmem.reserve_emulated_memory()
from tfmem.run.placement import accelerator
from tfmem.memory import scratch
from tfmem.cli.tf2_models import build_convnet
step, variables, (x, y) = build_convnet(tf, np, 0)
out = {}
left_path = cache_path + ".left.npz"
if stage == "reference":  # tf.function's peak, uncapped
    plain = tf.function(step)
    plain(x, y)
    accelerator.reset_peak("CPU:0")
    plain(x, y)
    out["plain_peak"] = accelerator.device_memory("CPU:0")["peak"]
elif stage == "plain":  # tf.function's steps from the weights the failed call left
    left = np.load(left_path)
    for number, variable in enumerate(variables):
        variable.assign(left[str(number)])
    plain = tf.function(step)
    out["losses"] = [np.asarray(plain(x, y)).tobytes().hex() for _ in range(steps)]
    out["weights"] = [v.numpy().tobytes().hex() for v in variables]
else:
    fn = tfmem.function(step, partition_size="auto")  # the whole device as budget
    concrete = fn.get_concrete_function(x, y)
    from tfmem.plan.analyse import analyse
    graph = concrete.graph
    view = analyse([t for t in graph.outputs], list(graph.control_outputs), graph.inputs)
    scratch.write_stale_cache(cache_path, graph, view, {})
    os.environ[scratch.CACHE_ENV] = cache_path
    try:
        fn(x, y)
        out["error"] = None
    except tfmem.DeviceMemoryError as err:
        out["error"] = "\n".join([str(err)] + list(getattr(err, "__notes__", ())))
    np.savez(left_path, **{str(n): v.numpy() for n, v in enumerate(variables)})
    out["steps"] = []
    for _ in range(steps):
        loss = fn(x, y)
        out["steps"].append(dict(loss=np.asarray(loss).tobytes().hex(),
                                 partitions=fn.last_step.partitions))
    out["weights"] = [v.numpy().tobytes().hex() for v in variables]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_function_budget_mode_plans_again_after_a_call_runs_out_of_device_memory(tmp_path):
    """The same for tfmem.function (eager TensorFlow, a convolution net)."""
    plain_peak, cap_mib, out, plain = _runs(TF2_SCRIPT, tmp_path, STEPS)
    print(f"\nplain peak {plain_peak / MIB:.2f} MiB, cap {cap_mib} MiB; {out['error']}; "
          f"then {[s['partitions'] for s in out['steps']]} partitions")
    assert out["error"] is not None, "the first call did not run out: the test proves nothing"
    assert "Budget mode took this in" in out["error"], out["error"]
    assert len({s["partitions"] for s in out["steps"]}) == 1 and out["steps"][0]["partitions"] > 1
    assert [s["loss"] for s in out["steps"]] == plain["losses"]
    assert out["weights"] == plain["weights"]
