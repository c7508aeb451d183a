"""Benchmark: `tfmem.function` against `tf.function` on a training step that fits.

    python tools/bench_tf2.py [--quick] [--steps N] [--warmup N] [--blocks 3 3 3]
                              [--batch 32] [--partition-sizes 200 auto] [--intra 1]
                              [--inter 2] [--onednn 0|1] [--json OUT.json]

`--json experiments/results/tf2_speed.json` writes the result file that
`tools/results_tables.py` renders into docs/results.md (Performance) (with its
provenance: commit, TensorFlow version, oneDNN on/off, cores, load, date).

A Keras ResNet (3 stages of residual blocks, Conv2D + BatchNormalization +
ReLU, width 16, 32x32 images, SGD with momentum) is trained by a custom
training step written once and wrapped twice: `tf.function` on one copy of
the model and `tfmem.function` on an identically seeded copy.  Per
configuration (partition_size 200; "auto" = budget mode with a budget far
above the step's peak, so tfmem should choose one partition) the tool times:

* the first step of each (tracing, and for tfmem planning and compiling one
  function per partition), side by side;
* `--steps` steps after `--warmup`, alternating plain and tfmem with the
  order flipped every step: medians, `ratio` (median tfmem / median plain),
  `paired` (median of adjacent-step ratios) and `cpu` (the same for process
  CPU time, less disturbed by other load on the machine).

Losses of the two copies are compared on every step: the steps whose
losses differ and the largest relative difference are printed.  The
thread pools are pinned (`--intra 1 --inter 2` by default, through
`tf.config.threading` before TensorFlow starts its runtime) so that the
comparison and the timings do not depend on the machine's core count:
with TensorFlow's default intra-op threads the ResNet's losses drifted by
float rounding.
Goals: ratio <= 1.15 at partition_size 200 and <= 1.02 in budget mode,
printed as `TARGET name=value (goal ...) ok|MISSED` lines.  The process
runs with TF_ENABLE_ONEDNN_OPTS=0 unless set otherwise (`--onednn 1`).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

from tfmem.cli.tf2_models import build_resnet, make_step  # noqa: E402  (imports no TensorFlow)

GOALS = {"200": 1.15, "auto": 1.02}  # tfmem / tf.function step time when it fits


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 timed steps, 2 warm-up")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--blocks", type=int, nargs=3, default=(3, 3, 3))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--partition-sizes", nargs="+", default=["200", "auto"])
    parser.add_argument("--budget", default="8GiB", help="the budget of the 'auto' configuration")
    parser.add_argument("--onednn", choices=("0", "1"), default="0")
    parser.add_argument("--intra", type=int, default=1, help="intra-op threads (pinned)")
    parser.add_argument("--inter", type=int, default=2, help="inter-op threads (pinned)")
    parser.add_argument("--json", metavar="OUT.json")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 6, 2
    return args


def _timed(fn, *args):
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn(*args)
    value = float(value)  # waits for the step's result
    return value, time.perf_counter() - wall, time.process_time() - cpu


def _relative(expected, got):
    return abs(got - expected) / max(abs(expected), 1e-30)


def run_configuration(tf, keras, tfmem, args, size, data):
    x, y = data
    plain_model, tfmem_model = (build_resnet(keras, args.blocks) for _ in range(2))
    plain = tf.function(make_step(tf, keras, plain_model))
    options = (dict(device_memory_budget=args.budget) if size == "auto"
               else dict(partition_size=int(size)))
    partitioned = tfmem.function(make_step(tf, keras, tfmem_model), **options)
    loss_plain, first_plain, _ = _timed(plain, x, y)
    loss_tfmem, first_tfmem, _ = _timed(partitioned, x, y)
    diffs = [_relative(loss_plain, loss_tfmem)]
    for _ in range(args.warmup):
        diffs.append(_relative(_timed(plain, x, y)[0], _timed(partitioned, x, y)[0]))
    times = {"plain": [], "tfmem": [], "plain_cpu": [], "tfmem_cpu": []}
    for i in range(args.steps):
        order = (("plain", plain), ("tfmem", partitioned))
        losses = {}
        for name, fn in (order if i % 2 == 0 else order[::-1]):
            losses[name], wall, cpu = _timed(fn, x, y)
            times[name].append(wall)
            times[name + "_cpu"].append(cpu)
        diffs.append(_relative(losses["plain"], losses["tfmem"]))
    plan = partitioned.plan(x, y)
    median = {k: statistics.median(v) for k, v in times.items()}
    return dict(
        partition_size=size, partitions=len(plan.partitions), ops=plan.num_ops,
        plain_ms=median["plain"] * 1e3, tfmem_ms=median["tfmem"] * 1e3,
        ratio=median["tfmem"] / median["plain"],
        paired=statistics.median(t / p for t, p in zip(times["tfmem"], times["plain"])),
        cpu_ratio=median["tfmem_cpu"] / median["plain_cpu"],
        first_plain_s=first_plain, first_tfmem_s=first_tfmem,
        loss_diff_steps=sum(d > 0 for d in diffs), max_loss_rel_diff=max(diffs),
        first_diff_step=next((i for i, d in enumerate(diffs) if d > 0), None),
        steps=args.steps, times=times)


def start_tensorflow(args):
    """(numpy, tensorflow, keras), TensorFlow started with the kernel path (`args.onednn`,
    set before it loads) and the thread pools (`args.intra`, `args.inter`) asked for."""
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = args.onednn
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(args.intra)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter)
    return np, tf, keras


def main():
    args = _parse()
    np, tf, keras = start_tensorflow(args)
    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.cli import child_env, provenance  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(0)
    data = (tf.constant(rng.standard_normal((args.batch, 32, 32, 3)).astype(np.float32)),
            tf.constant(rng.integers(0, 10, args.batch).astype(np.int32)))
    load = os.getloadavg()[0]
    print(f"tfmem.function vs tf.function: Keras ResNet blocks {tuple(args.blocks)}, width 16, "
          f"32x32, batch {args.batch}, SGD momentum; {args.steps} steps per side after "
          f"{args.warmup} warm-up, alternating; TF_ENABLE_ONEDNN_OPTS={args.onednn}, "
          f"intra-op threads {args.intra}, inter-op {args.inter}; load average {load:.1f}")
    print(f"{'part.size':>9} {'parts':>5} {'ops':>5} {'plain ms':>8} {'tfmem ms':>8} "
          f"{'ratio':>6} {'paired':>6} {'cpu':>5} {'first plain s':>13} {'first tfmem s':>13} "
          f"{'loss differs':>12} {'max rel diff':>12}")
    rows = []
    for size in args.partition_sizes:
        row = run_configuration(tf, keras, tfmem, args, size, data)
        rows.append(row)
        print(f"{size:>9} {row['partitions']:>5} {row['ops']:>5} {row['plain_ms']:>8.1f} "
              f"{row['tfmem_ms']:>8.1f} {row['ratio']:>6.3f} {row['paired']:>6.3f} "
              f"{row['cpu_ratio']:>5.2f} {row['first_plain_s']:>13.1f} "
              f"{row['first_tfmem_s']:>13.1f} "
              f"{row['loss_diff_steps']:>5} of {args.steps + args.warmup + 1:<3} "
              f"{row['max_loss_rel_diff']:>12.1e}", flush=True)
    for row in rows:
        goal = GOALS.get(str(row["partition_size"]))
        if goal:
            verdict = "ok" if row["ratio"] <= goal else "MISSED"
            print(f"TARGET step_ratio_{row['partition_size']}={row['ratio']:.3f} "
                  f"(goal <= {goal}) {verdict}")
    if args.json:
        origin = provenance.provenance(child_env.kernel_path(args.onednn == "1"))
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(dict(kind="tf2-speed", goals=GOALS, load_average_at_start=load,
                           args=vars(args), rows=rows, provenance=origin), out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
