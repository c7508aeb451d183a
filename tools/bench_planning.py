"""How planning time grows with the graph: seconds against ops, both planning modes.

    python tools/bench_planning.py [--blocks 5 57 570] [--json OUT.json]

For each size, a ResNet training step (`tfmem.cli.models.resnet` with the third stage
deepened to `blocks`: moments batch normalisation whose moving averages are updated
under `control_dependencies`, momentum SGD; 32x32 images, width 16, batch 16; measuring
kernel scratch is part of the budget figure) is planned in a fresh TFMemSession:

- fixed: `partition_size=200`, `tfs.plan(...)` (analysis, partitioning, the plan);
- budget: a `device_memory_budget` halfway between the predicted peaks of one op per
  partition and of the whole step, so that budget mode has to search; its time is split
  into analysis, sizing (tensor shapes, kernel scratch measured by running kernels) and
  the search (`budget.fit`).

Each figure is the best of `--repeats` runs (wall and CPU seconds); sizing runs once.  The growth
exponent is the slope of log(seconds) against log(ops) between the smallest and the
largest size (1.0: linear).  Results go to experiments/results/planning.json with
their provenance.
"""

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tfmem  # noqa: E402
from tfmem.cli import models  # noqa: E402
from tfmem.cli.provenance import provenance  # noqa: E402
from tfmem.memory import budget  # noqa: E402
from tfmem.memory.sizing import Sizing  # noqa: E402
from tfmem.plan.analyse import analyse  # noqa: E402
from tfmem.plan.build import make_plan  # noqa: E402
from tfmem.plan.gc_pause import gc_paused  # noqa: E402
from tfmem.plan.swap import SwapPolicy  # noqa: E402

BATCH = 16
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(function):
    """(result, wall seconds, CPU seconds) of `function()`, with the cyclic collector held
    off as the front ends plan."""
    wall, cpu = time.perf_counter(), time.process_time()
    with gc_paused():
        result = function()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _best(runs):
    """The run with the least wall time among `runs` ((result, wall, cpu) each)."""
    return min(runs, key=lambda run: run[1])


def measure(blocks, repeats):
    """Planning figures of one ResNet size (see the module docstring)."""
    model, build_seconds, _ = _timed(lambda: models.resnet(blocks=(1, 1, blocks), width=16,
                                                           image=32))
    feed = model.feed(BATCH)
    fetches = [model.train, model.loss]
    session = tf.compat.v1.Session(graph=model.graph)
    session.run(model.init)
    row = dict(blocks=blocks, graph_ops=len(model.graph.get_operations()),
               build_seconds=round(build_seconds, 2))

    def fixed():
        return tfmem.TFMemSession(session, partition_size=200).plan(fetches, feed_dict=feed)

    plan, wall, cpu = _best([_timed(fixed) for _ in range(repeats)])
    row.update(ops=len(plan.view.nodes), fixed_partitions=len(plan.partitions),
               fixed_seconds=round(wall, 3), fixed_cpu_seconds=round(cpu, 3))

    view = analyse([model.loss], [model.train], list(model.inputs))
    feed_shapes = {t.name: v.shape for t, v in feed.items()}
    sizing, sizing_wall, sizing_cpu = _timed(lambda: Sizing.of(model.graph, view, feed_shapes,
                                                               session))
    def predicted(partition_size):  # as budget mode predicts the view it searches
        plan = make_plan(view, partition_size, SwapPolicy(swap_distance=0))
        return budget.predict(plan, sizing).peak_device

    # Halfway between one op per partition and the whole step: budget mode must search.
    floor, whole = predicted(1), predicted(len(view.nodes) + 1)
    budget_bytes = int((floor + (whole - floor) / 2) / (1 - budget.DEFAULT_MARGIN))

    runs = []
    for _ in range(repeats):
        fresh_view, analyse_wall, analyse_cpu = _timed(
            lambda: analyse([model.loss], [model.train], list(model.inputs)))
        (fitted, _), fit_wall, fit_cpu = _timed(
            lambda v=fresh_view: budget.fit(v, sizing, budget_bytes))
        runs.append(((fitted, analyse_wall, analyse_cpu), analyse_wall + fit_wall,
                     analyse_cpu + fit_cpu, fit_wall, fit_cpu))
    best = min(runs, key=lambda run: run[1])
    (fitted, analyse_wall, analyse_cpu), wall, cpu, fit_wall, fit_cpu = best
    row.update(budget_mib=round(budget_bytes / 2 ** 20, 1),
               budget_partitions=len(fitted.partitions),
               budget_partition_size=fitted.partition_size,
               analyse_seconds=round(analyse_wall, 3), analyse_cpu_seconds=round(analyse_cpu, 3),
               sizing_seconds=round(sizing_wall, 3), sizing_cpu_seconds=round(sizing_cpu, 3),
               search_seconds=round(fit_wall, 3), search_cpu_seconds=round(fit_cpu, 3),
               budget_seconds=round(wall + sizing_wall, 3),
               budget_cpu_seconds=round(cpu + sizing_cpu, 3))
    session.close()
    return row


def exponent(rows, key):
    """Slope of log(rows[key]) against log(ops) from the smallest to the largest size."""
    small, large = rows[0], rows[-1]
    if small[key] <= 0 or large[key] <= 0 or large["ops"] == small["ops"]:
        return None
    return math.log(large[key] / small[key]) / math.log(large["ops"] / small["ops"])


def markdown(data, provenance_text):
    """The result file's table: seconds per size in both modes, and the growth exponents."""
    blocks = " ".join(str(row["blocks"]) for row in data["rows"])
    lines = [f"`python tools/bench_planning.py --blocks {blocks}` ({provenance_text}). "
             "CPU seconds of the planning process (on a shared machine they move less than "
             "wall seconds, given last):", "",
             "| ops | fixed: plan s | budget: analyse s | sizing s | search s | total s | "
             "partitions | wall s fixed / budget |", "|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        lines.append(f"| {row['ops']} | {row['fixed_cpu_seconds']:.2f} | "
                     f"{row['analyse_cpu_seconds']:.2f} | {row['sizing_cpu_seconds']:.2f} | "
                     f"{row['search_cpu_seconds']:.2f} | {row['budget_cpu_seconds']:.2f} | "
                     f"{row['budget_partitions']} | "
                     f"{row['fixed_seconds']:.2f} / {row['budget_seconds']:.2f} |")
    growth = data["growth_exponent"]
    named = (("fixed", "fixed_cpu_seconds"), ("budget search", "search_cpu_seconds"),
             ("budget total", "budget_cpu_seconds"))
    if all(growth[key] is not None for _, key in named):
        lines += ["", "Growth exponent (CPU seconds against ops, smallest to largest size): "
                  + ", ".join(f"{label} {growth[key]:.2f}" for label, key in named) + "."]
    lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[5, 57, 570],
                        help="third-stage blocks of each size (default: about 1k, 10k and "
                             "100k ops)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=os.path.join(REPOSITORY, "experiments", "results",
                                                      "planning.json"))
    args = parser.parse_args(argv)
    started = provenance("onednn" if os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1" else "eigen")
    rows = []
    print(f"{'ops':>7} {'fixed s':>8} {'analyse s':>9} {'sizing s':>9} {'search s':>9} "
          f"{'budget s':>9} {'parts':>6}")
    for blocks in sorted(args.blocks):
        row = measure(blocks, args.repeats)
        rows.append(row)
        print(f"{row['ops']:>7} {row['fixed_seconds']:>8.2f} {row['analyse_seconds']:>9.2f} "
              f"{row['sizing_seconds']:>9.2f} {row['search_seconds']:>9.2f} "
              f"{row['budget_seconds']:>9.2f} {row['budget_partitions']:>6}", flush=True)
    growth = {key: exponent(rows, key) for key in ("fixed_seconds", "search_seconds",
                                                   "budget_seconds", "fixed_cpu_seconds",
                                                   "search_cpu_seconds", "budget_cpu_seconds")}
    for key, value in growth.items():
        if value is not None:
            print(f"growth exponent of {key}: {value:.2f}")
    result = dict(kind="planning", provenance=started, rows=rows, growth_exponent=growth)
    with open(args.json, "w") as out:
        json.dump(result, out, indent=1)
    exponents = " ".join(f"exponent_{key.split('_')[0]}={growth[key]:.2f}"
                         for key in ("fixed_seconds", "budget_seconds")
                         if growth[key] is not None)
    print(f"RESULT planning ops={rows[-1]['ops']} fixed={rows[-1]['fixed_seconds']}s "
          f"budget={rows[-1]['budget_seconds']}s {exponents}".rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
