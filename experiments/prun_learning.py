"""Budget mode learning on the partial-run path: which kernel scratch to take in.

A partial-run step has no step statistics, so when it measured over its
prediction (by TensorFlow's process peak around each call, run/call_peaks.py)
the per-op kernel scratch the callables' statistics would give is missing.
Two ways, compared here on the same start: a ResNet (14 layers, batch 32)
under an emulated cap a little above its plain step's peak, in budget mode
(a budget a MiB below the device), with a stale kernel scratch cache (every kernel
recorded with no scratch, as a file from another machine might say):

    recalibrate   what tfmem does: the request's kernels calibrated again past the
                  cache (run/remeasure.py), then the factor for what is still missing
    factor        no scratch: the factor alone (measured peak / prediction)

Each arm runs in its own process (oneDNN off, one thread per pool): a first
step (one partition, predicted without scratch), the re-plan, then steps of
the new plan whose peaks this script reads by resetting TensorFlow's peak
(its own process; tfmem never does).

    python experiments/prun_learning.py [--steps 3] [--out FILE.json]
"""

import argparse
import json
import math
import os
import subprocess
import sys

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tfmem.cli import provenance  # noqa: E402  pylint: disable=wrong-import-position

CHILD = r"""
import json, os, sys, tempfile, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(int(sys.argv[1]))
import tensorflow as tf
from tfmem.cli import models
from tfmem.memory import scratch
from tfmem.run import accelerator, remeasure
tf1 = tf.compat.v1
arm, steps = sys.argv[2], int(sys.argv[3])
model = models.resnet(blocks=(2, 2, 2))
config = tfmem.session_config(tf1.ConfigProto(intra_op_parallelism_threads=1,
                                              inter_op_parallelism_threads=1))
feed, fetches = model.feed(32), [model.train, model.loss]
sess = tf1.Session(graph=model.graph, config=config)
sess.run(model.init)
if arm == "reference":
    accelerator.reset_peak("CPU:0")
    sess.run(fetches, feed)
    print(json.dumps({"plain_peak": accelerator.device_memory("CPU:0")["peak"]}))
    sys.exit(0)
cache_path = os.path.join(tempfile.mkdtemp(), "kernels.json")
view = tfmem.TFMemSession(sess, partition_size=100000).plan(fetches, feed).view
scratch.write_stale_cache(cache_path, model.graph, view,
                          {t.name: v.shape for t, v in feed.items()}, sess)
os.environ[scratch.CACHE_ENV] = cache_path
seconds = []
original = remeasure.request_scratch
def timed(*args):
    started = time.perf_counter()
    seen = original(*args) if arm == "recalibrate" else {}
    seconds.append(time.perf_counter() - started)
    return seen
remeasure.request_scratch = timed
# A budget a MiB below the device: on the whole device a step that ran teaches only
# kernel scratch, never a factor (budget.Correction.learn), and the factor arm would
# learn nothing at all.
tfs = tfmem.TFMemSession(sess, device_memory_budget=f"{int(sys.argv[1]) - 1}MiB",
                         partial_runs=True)
out = {"steps": []}
for number in range(steps):
    if number:
        accelerator.reset_peak("CPU:0")  # this script's own figure: each step's peak
    try:
        tfs.run(fetches, feed)
    except tf.errors.ResourceExhaustedError as err:
        out["steps"].append({"error": str(err).splitlines()[0][:200]})
        break
    out["steps"].append(dict(partitions=tfs.last_step.partitions,
                             partial_run=tfs.last_step.partial_run,
                             predicted=tfs.memory_report().predicted_device_peak,
                             peak=accelerator.device_memory("CPU:0")["peak"]))
out["remeasure_seconds"] = seconds
print(json.dumps(out))
"""


def child(cap_mib, arm, steps):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFMEM_SCRATCH_CACHE", None)
    done = subprocess.run([sys.executable, "-c", CHILD, str(cap_mib), arm, str(steps)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    if done.returncode:
        return {"error": done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    plain = child(4096, "reference", 1)["plain_peak"]
    cap = math.ceil(plain * 1.06 / MIB)
    results = {"plain_peak_mib": plain / MIB, "cap_mib": cap, "load": os.getloadavg()}
    print(f"plain step peak {plain / MIB:.2f} MiB, cap {cap} MiB")
    for arm in ("recalibrate", "factor"):
        result = results[arm] = child(cap, arm, args.steps)
        for number, step in enumerate(result.get("steps", []), 1):
            if "error" in step:
                print(f"  {arm:12s} step {number}: {step['error']}")
                continue
            print(f"  {arm:12s} step {number}: {step['partitions']:3d} partitions, predicted "
                  f"{step['predicted'] / MIB:6.2f} MiB, measured {step['peak'] / MIB:6.2f} MiB"
                  f" (partial run: {step['partial_run']})")
        if "error" in result:
            print(f"  {arm:12s} failed: {result['error']}")
        else:
            print(f"  {arm:12s} scratch measured again in "
                  f"{sum(result['remeasure_seconds']):.2f} s")
    results["provenance"] = provenance.provenance("oneDNN off")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
