"""Steady-state step time of partial runs against callables, ratios against plain in one run.

    python experiments/partial_runs.py [--sizes 50 200] [--steps 10] [--out FILE.json]

ResNet-56 (batch 32) on one graph; three sessions with tfmem's config
(Grappler off), all initialised alike: plain `Session.run`, a TFMemSession
with callables and one with `partial_runs=True`.  After each tfmem side's
first step (timed, split into setup and the rest) and two warm-up steps,
steps rotate plain / callables / partial runs (the order shifts every
round), and the medians and paired ratios are printed.  The losses of the
three sides are compared bit for bit at every round (every side trains the
same weights from the same start: three sessions, three copies).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfmem  # noqa: E402
from tfmem.cli import models, provenance  # noqa: E402


def measure(size, steps):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    model = models.resnet(blocks=(9, 9, 9))
    feed = model.feed(32)
    fetches = [model.train, model.loss]
    config = tfmem.session_config(tf1.ConfigProto())
    sessions = {name: tf1.Session(graph=model.graph, config=config)
                for name in ("plain", "callables", "partial")}
    for session in sessions.values():
        session.run(model.init)
    sides = {"plain": sessions["plain"].run,
             "callables": tfmem.TFMemSession(sessions["callables"], partition_size=size).run,
             "partial": tfmem.TFMemSession(sessions["partial"], partition_size=size,
                                           partial_runs=True).run}
    first = {}
    for name in ("plain", "callables", "partial"):
        started = time.perf_counter()
        sides[name](fetches, feed)
        first[name] = time.perf_counter() - started
    for _ in range(2):
        for name in sides:
            sides[name](fetches, feed)
    times = {name: [] for name in sides}
    equal = True
    order = list(sides)
    for step in range(steps):
        losses = {}
        for name in order[step % 3:] + order[:step % 3]:
            started = time.perf_counter()
            losses[name] = sides[name](fetches, feed)[1]
            times[name].append(time.perf_counter() - started)
        equal = equal and bool(losses["plain"] == losses["callables"] == losses["partial"])
    for session in sessions.values():
        session.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    paired = {name: statistics.median(a / b for a, b in zip(times[name], times["plain"]))
              for name in ("callables", "partial")}
    return dict(partition_size=size, first_step_s=first, step_ms={k: v * 1e3 for k, v in med.items()},
                ratio={k: med[k] / med["plain"] for k in ("callables", "partial")},
                paired_ratio=paired, losses_bit_equal=equal,
                times_ms={k: [t * 1e3 for t in v] for k, v in times.items()})


def markdown(data, provenance_text):
    """The docs/results.md table of a result file (tools/results_tables.py renders it)."""
    args = data["args"]
    lines = [
        f"`python experiments/partial_runs.py --sizes {' '.join(map(str, args['sizes']))} "
        f"--steps {args['steps']} --out experiments/results/partial-runs.json` (ResNet-56, "
        f"batch 32, tfmem config on all three sessions, steps rotating plain / callables / "
        f"partial runs; {provenance_text}):", "",
        "| partition_size | plain step ms | callables ms (x plain, paired) | partial runs ms "
        "(x plain, paired) | losses bit-equal | first step s: plain / callables / partial runs |",
        "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        s, x, p, f = r["step_ms"], r["ratio"], r["paired_ratio"], r["first_step_s"]
        lines.append(
            f"| {r['partition_size']} | {s['plain']:.0f} | {s['callables']:.0f} "
            f"({x['callables']:.3f}, {p['callables']:.3f}) | {s['partial']:.0f} "
            f"({x['partial']:.3f}, {p['partial']:.3f}) | "
            f"{'yes' if r['losses_bit_equal'] else 'NO'} | "
            f"{f['plain']:.1f} / {f['callables']:.1f} / {f['partial']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    rows = [measure(size, args.steps) for size in args.sizes]
    kernel_path = "oneDNN on" if os.environ["TF_ENABLE_ONEDNN_OPTS"] == "1" else "oneDNN off"
    result = dict(kind="partial-runs", args=dict(sizes=args.sizes, steps=args.steps),
                  provenance=provenance.provenance(kernel_path), rows=rows)
    print(markdown(result, provenance.describe(result["provenance"])))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
