"""Budget mode under emulated caps: the README's budget-mode table.

    python tools/budget_table.py [--caps 200 60 40] [--steps 4]

The memory proof's 24-layer MLP (width 256) at batch 2048, trained with
`TFMemSession(sess, partition_size="auto")` in one fresh process per cap
(TF_ENABLE_ONEDNN_OPTS=0, pinned thread pools), beside plain TensorFlow's
losses from an uncapped process.  Prints one Markdown row per cap: the plan
chosen, its predicted and measured peaks (TensorFlow's allocator, the worst
step after the first), the step time, and whether the losses match plain's.
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
cap, steps = int(sys.argv[1]), int(sys.argv[2])
if cap:
    tfmem.emulate_accelerator(cap)
import tensorflow as tf
from tfmem.run import accelerator
from tfmem.cli.proof import build_model
import numpy as np
graph, x, loss, train, init = build_model(tf, layers=24, batch=2048, width=256, seed=0)
feed_value = np.random.default_rng(0).standard_normal((2048, 256)).astype(np.float32)
config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
sess = tf.compat.v1.Session(graph=graph, config=config)
runner = tfmem.TFMemSession(sess, partition_size="auto") if cap else sess
runner.run(init)
out = {"losses": [], "peaks": [], "times": []}
for _ in range(steps):
    started = time.perf_counter()
    _, value = runner.run([train, loss], {x: feed_value})
    out["times"].append(time.perf_counter() - started)
    out["losses"].append(float(value))
    if cap:
        out["peaks"].append(runner.last_step.device_peak_bytes)
        out["partitions"] = runner.last_step.partitions
        out["swapped"] = runner.last_step.swapped_out
if cap:
    report = runner.memory_report()
    out["predicted"] = report.predicted_device_peak
    out["peak_process"] = accelerator.device_memory("CPU:0")["peak"]
print(json.dumps(out))
"""


def run(cap, steps):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, "-c", CHILD, str(cap), str(steps)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", type=int, nargs="+", default=[200, 60, 40])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    plain = run(0, args.steps)
    print("| cap | chosen plan | predicted peak | measured peak (worst step) | step | losses |")
    print("|---|---|---|---|---|---|")
    for cap in args.caps:
        result = run(cap, args.steps)
        if "error" in result:
            print(f"| {cap} MiB | failed: {result['error']} | | | | |")
            continue
        plan = ("1 partition (whole step)" if result["partitions"] == 1 else
                f"{result['partitions']} partitions, {result['swapped']} tensors swapped")
        worst = max(result["peaks"][1:] or result["peaks"])
        step = sorted(result["times"][1:])[len(result["times"][1:]) // 2]
        same = result["losses"] == plain.get("losses")
        print(f"| {cap} MiB | {plan} | {result['predicted'] / MIB:.1f} MiB | "
              f"{worst / MIB:.1f} MiB | {step * 1e3:.0f} ms | "
              f"{'same as plain' if same else 'DIFFER from plain'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
