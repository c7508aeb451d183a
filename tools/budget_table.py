"""Budget mode under emulated caps: the budget-mode table of docs/results.md.

    python tools/budget_table.py [--caps 200 60 40] [--steps 4]
                                 [--json experiments/results/budget.json]

The memory proof's 24-layer MLP (width 256) at batch 2048, trained with
`TFMemSession(sess, partition_size="auto")` in one fresh process per cap
(TF_ENABLE_ONEDNN_OPTS=0, pinned thread pools), beside plain TensorFlow's
losses from an uncapped process.  Prints one Markdown row per cap: the plan
chosen, its predicted and measured peaks (TensorFlow's allocator, the worst
step after the first), the step time, and whether the losses match plain's.
Writes every figure, with its provenance (commit, TensorFlow, kernel path,
cores, date) and the budget margin, to the JSON file, from which
`python tools/results_tables.py` renders the block in docs/results.md.
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
from tfmem.run.placement import accelerator
from tfmem.cli.proof import build_model
import numpy as np
graph, x, loss, train, init = build_model(tf, layers=24, batch=2048, width=256, seed=0)
feed_value = np.random.default_rng(0).standard_normal((2048, 256)).astype(np.float32)
config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
sess = tf.compat.v1.Session(graph=graph, config=config)
runner = tfmem.TFMemSession(sess, partition_size="auto",
                            options=tfmem.Options(measure="every")) if cap else sess
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


def rows(plain, results):
    """The table's rows (dicts) from plain's run and {cap: run}."""
    out = []
    for cap, result in results.items():
        if "error" in result:
            out.append(dict(cap_mib=cap, error=result["error"]))
            continue
        later = result["peaks"][1:] or result["peaks"]
        times = result["times"][1:] or result["times"]
        out.append(dict(cap_mib=cap, partitions=result["partitions"],
                        swapped=result["swapped"], predicted_bytes=result["predicted"],
                        worst_peak_bytes=max(later), peaks=result["peaks"],
                        step_seconds=sorted(times)[len(times) // 2],
                        same_losses=result["losses"] == plain.get("losses")))
    return out


def markdown(table_rows):
    """The Markdown table of `rows`."""
    lines = ["| cap | chosen plan | predicted peak | measured peak (worst step) | step | losses |",
             "|---|---|---|---|---|---|"]
    for row in table_rows:
        cap = row["cap_mib"]
        if "error" in row:
            lines.append(f"| {cap} MiB | failed: {row['error']} | | | | |")
            continue
        plan = ("1 partition (whole step)" if row["partitions"] == 1 else
                f"{row['partitions']} partitions, {row['swapped']} tensors swapped")
        lines.append(f"| {cap} MiB | {plan} | {row['predicted_bytes'] / MIB:.1f} MiB | "
                     f"{row['worst_peak_bytes'] / MIB:.1f} MiB | "
                     f"{row['step_seconds'] * 1e3:.0f} ms | "
                     f"{'same as plain' if row['same_losses'] else 'DIFFER from plain'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caps", type=int, nargs="+", default=[200, 60, 40])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=os.path.join(ROOT, "experiments", "results",
                                                       "budget.json"),
                        help="where to write the figures (default experiments/results/"
                             "budget.json)")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    from tfmem.memory import budget  # pylint: disable=import-outside-toplevel
    from tfmem.cli import provenance  # pylint: disable=import-outside-toplevel
    plain = run(0, args.steps)
    table_rows = rows(plain, {cap: run(cap, args.steps) for cap in args.caps})
    print(markdown(table_rows))
    data = dict(kind="budget-table", caps=args.caps, steps=args.steps,
                margin=budget.DEFAULT_MARGIN, plain_losses=plain.get("losses"),
                rows=table_rows, provenance=provenance.provenance("oneDNN off"))
    with open(args.json, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
