"""Simulator accuracy: tfmem's predicted device peak against TensorFlow's measured one.

    python experiments/accuracy.py                       # both kernel paths and layouts
    python experiments/accuracy.py --json experiments/results/accuracy.json

The one measurement behind both `tests/test_simulate.py` (which bounds the
errors) and the accuracy table of docs/results.md (rendered from the result file by
`python tools/results_tables.py`): for each model of `MODELS` and partition
size of `SIZES`, train `STEPS` steps through `TFMemSession(options=tfmem.Options(measure="every"))`
and compare, per step, TensorFlow's allocator peak with tfmem's two predicted
figures (bytes requested; the same allocations replayed in BFC chunks).

One fresh process per kernel path (`TF_ENABLE_ONEDNN_OPTS=0` and `=1`, set
explicitly: a machine of either kind measures both) and allocator layout
(`LAYOUTS`: regions grown on demand, or the memory reserved as one region
first, as a GPU's allocator holds it), each with TensorFlow's BFC allocator
limited far above the step (figures on every kernel path, no cap) and pinned
thread pools (1 intra-op, 1 inter-op thread), so that no figure depends on
the machine's core count.  The processes run at once: memory, not time, is
measured.  Steps 2..STEPS are judged (the first warms caches): the median
step, and the worst one.
"""

import argparse
import gc
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MIB = 1 << 20
# (model builder of tfmem.cli.models, builder kwargs, batch); "conv" and "pool" are nets
# of shapes the simulator was not tuned on (odd channels and image sizes, strides, pooling).
MODELS = {
    "resnet": ("resnet", dict(blocks=(1, 1, 1)), 32),
    "rnn": ("unrolled_rnn", dict(steps=16), 256),
    "mlp": ("mlp", dict(layers=12), 1024),
    "moe": ("moe", {}, 32),
    "conv": ("convnet", {}, 48),
    "pool": ("convnet", dict(channels=(7, 33, 21), strides=(2, 1, 1), image=41, pool="avg"),
             96),
}
SIZES = (100000, 200, 50, 20)  # partition sizes; 100000: the whole step in one partition
PATHS = {"eigen": False, "onednn": True}  # kernel path -> oneDNN on
# allocator layout -> whether the process reserves its memory as one region first
# (tfmem.reserve_emulated_memory, as a GPU's allocator holds it) instead of growing
# regions of 2, 4, 8 ... MiB on demand
LAYOUTS = {"grown": False, "one-region": True}
# Steps 2..STEPS are judged (the first warms caches).  Five judged steps: one step whose
# allocations the prefetch thread or the load interleaved differently moves the median no more.
STEPS = 6
TIMEOUT = 1500  # seconds per kernel path on a loaded shared machine


# --------------------------------------------------------------------------
# the measuring process


def model_session(builder, kwargs):
    """A model of tfmem.cli.models and a plain Session on its graph.  Pinned thread pools:
    the figures must not depend on the machine's core count."""
    # pylint: disable=import-outside-toplevel
    import tensorflow as tf
    from tfmem.cli import models as builders

    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    model = getattr(builders, builder)(**kwargs)
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    return model, tf.compat.v1.Session(graph=model.graph, config=config)


def measured_session(builder, kwargs, batch, size):
    """(model, sess, tfs, feed, fetches): `model_session`'s model initialised, a
    TFMemSession at partition size `size` that measures every step, and one training
    step's feed and fetches (arrays off a 64-byte boundary, see `unaligned`)."""
    import tfmem  # pylint: disable=import-outside-toplevel
    model, sess = model_session(builder, kwargs)
    tfs = tfmem.TFMemSession(sess, partition_size=size, options=tfmem.Options(measure="every"))
    # Not sess.run(init): a plain run caches the initializer's folded constants
    # in the session for good, and they would count in every step's peak.
    tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
    feed = {tensor: unaligned(value) for tensor, value in model.feed(batch).items()}
    return model, sess, tfs, feed, [model.train, model.loss]


def unaligned(array):
    """A copy of `array` whose data starts 16 bytes past a 64-byte boundary.  TensorFlow
    copies such a fed array into an allocator for every run (one whose data is aligned
    it reads in place); where numpy happens to put a batch must not decide the figures,
    and tfmem aligns what it feeds (run/front_end/request.py: aligned_feed)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    raw = np.empty(array.nbytes + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + 16
    copy = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def measure(models, sizes, steps):
    """Rows of figures, one per (model, partition size); run in a process whose allocator
    was set before TensorFlow started (see `start`)."""
    # pylint: disable=import-outside-toplevel
    from tfmem.memory import budget
    from tfmem.memory.sizing import Sizing
    from tfmem.run.placement import accelerator

    rows = []
    for key, (builder, kwargs, batch) in models.items():
        for size in sizes:
            model, sess, tfs, feed, fetches = measured_session(builder, kwargs, batch, size)
            peaks, tfmem_peaks, foreign = [], [], []
            trace = tfs.simulate(fetches, feed)
            state = trace.state_bytes
            for _ in range(steps):
                # Bytes the allocator holds beyond this request's state when the step
                # starts (what earlier sessions of this process left, kernel library
                # caches): not the step's; budget mode takes them off the budget as resident.
                foreign.append(max(accelerator.device_memory("CPU:0")["current"] - state, 0))
                accelerator.reset_peak("CPU:0")  # this process's own measurement
                tfs.run(fetches, feed)
                peaks.append(accelerator.device_memory("CPU:0")["peak"])
                tfmem_peaks.append(tfs.last_step.device_peak_bytes)
            own = [p - f for p, f in zip(peaks, foreign)]
            report = tfs.memory_report()
            plan = tfs.plan(fetches, feed)
            feed_shapes = {t.name: v.shape for t, v in feed.items()}
            planned = budget.predict(plan, Sizing.of(model.graph, plan.view, feed_shapes, sess))
            rows.append(dict(model=key, partition_size=size, peaks=peaks,
                             tfmem_peaks=tfmem_peaks, load=os.getloadavg()[0],
                             foreign=foreign,
                             measured=sorted(own[1:])[(steps - 1) // 2],  # median
                             worst=max(own[1:]),
                             predicted=report.predicted_device_peak,
                             predicted_chunks=trace.peak_device_chunks,
                             planned=planned.peak_device,
                             report_peak=report.device_peak,
                             partition_peaks=report.partition_peaks,
                             predicted_partition_peaks=report.predicted_partition_peaks,
                             partitions=tfs.last_step.partitions))
            tfs.close()
            del tfs, sess, model, feed
            gc.collect()  # the session and its state go now, not amid the next model's run
    return rows


def _worker(models, sizes, steps, one_region):
    """The measuring process's body: one JSON line of rows on stdout.  `one_region`: the
    allocator reserves its memory as one region before anything allocates."""
    # pylint: disable=import-outside-toplevel
    from tfmem.memory.emulated import emulated_memory_mib, reserve_emulated_memory
    if emulated_memory_mib() is None:  # TensorFlow's default CPU allocator keeps no figures
        raise SystemExit("start the measuring process with accuracy.start(): it needs "
                         "TensorFlow's BFC allocator (tfmem.cli.child_env)")
    if one_region:
        import tensorflow  # noqa: F401  pylint: disable=unused-import
        reserve_emulated_memory()
    print(json.dumps(measure(models, sizes, steps)))


# --------------------------------------------------------------------------
# the parent: one process per kernel path


def start(onednn, models=None, sizes=SIZES, steps=STEPS, one_region=False):
    """Start the measuring process of one kernel path (oneDNN on or off) and allocator
    layout; `collect` reads it."""
    from tfmem.cli.child_env import child_env  # pylint: disable=import-outside-toplevel
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(models or MODELS),
         json.dumps(list(sizes)), str(steps), "1" if one_region else "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=child_env(onednn=onednn))


def collect(path, process, timeout=TIMEOUT, layout="grown"):
    """The rows of a process from `start`, each with its kernel path, allocator layout
    and errors."""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"accuracy process ({path}, {layout}) failed:\n{stderr[-4000:]}")
    return [with_errors(dict(row, path=path, layout=layout))
            for row in json.loads(stdout.strip().splitlines()[-1])]


def with_errors(row):
    """`row` with its relative errors: (predicted - measured) / measured for the median and
    the worst step, and the band's (0 when the measured peak lies between both figures)."""
    from tfmem.run.measuring.report_text import band_error  # pylint: disable=import-outside-toplevel
    row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
    row["worst_error"] = (row["predicted"] - row["worst"]) / row["worst"]
    row["band_error"] = band_error(row["predicted"], row["predicted_chunks"], row["measured"])
    row["band_worst_error"] = band_error(row["predicted"], row["predicted_chunks"], row["worst"])
    return row


def run(paths=None, models=None, sizes=SIZES, steps=STEPS, timeout=TIMEOUT, layouts=None):
    """Rows of every kernel path of `paths` ({name: oneDNN on}) in every allocator layout
    of `layouts` ({name of LAYOUTS: (models, sizes) measured in it}; by default every
    layout with `models` and `sizes`), one fresh process each, measured at once."""
    paths = PATHS if paths is None else paths
    layouts = {name: (models, sizes) for name in LAYOUTS} if layouts is None else layouts
    processes = {(path, layout): start(onednn, chosen, chosen_sizes, steps, LAYOUTS[layout])
                 for layout, (chosen, chosen_sizes) in layouts.items()
                 for path, onednn in paths.items()}
    try:
        return [row for (path, layout), process in processes.items()
                for row in collect(path, process, timeout, layout)]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


def line(row):
    """One row as text (the test prints these with -s)."""
    return (f"{row['path']:>6} {row.get('layout', 'grown'):>10} {row['model']:>6} "
            f"partition_size={row['partition_size']:<6} "
            f"partitions={row['partitions']:<3} predicted {row['predicted'] / MIB:6.2f} MiB "
            f"(in chunks {row['predicted_chunks'] / MIB:6.2f}) "
            f"measured {row['measured'] / MIB:6.2f} MiB  error {row['error']:+6.1%} "
            f"(band {row['band_error']:+6.1%}) "
            f"(worst step {row['worst_error']:+6.1%}; budget mode's bound "
            f"{row['planned'] / MIB:.1f} MiB)  "
            f"(steps {', '.join(f'{p / MIB:.1f}' for p in row['peaks'])}, of which not "
            f"the step's {max(row['foreign']) / MIB:.1f}; load {row['load']:.1f})")


def _size_name(size):
    return "one" if size >= max(SIZES) else str(size)


def markdown(rows):
    """The docs/results.md table: one line per kernel path, model and partition size."""
    lines = ["| kernel path | allocator | model | partition size | partitions | predicted MiB "
             "(requested / in chunks) | measured MiB (median / worst step) | error, median "
             "(worst) | error in chunks, median (worst) | outside the band, median (worst) |",
             "|---|---|---|---|---:|---|---|---|---|---|"]
    for r in rows:
        path = "oneDNN on" if r["path"] == "onednn" else "oneDNN off"
        lines.append(
            f"| {path} | {r.get('layout', 'grown')} | {r['model']} | "
            f"{_size_name(r['partition_size'])} | {r['partitions']} | "
            f"{r['predicted'] / MIB:.2f} / {r['predicted_chunks'] / MIB:.2f} | "
            f"{r['measured'] / MIB:.2f} / {r['worst'] / MIB:.2f} | "
            f"{r['error']:+.1%} ({r['worst_error']:+.1%}) | "
            f"{_chunks_error(r, 'measured'):+.1%} ({_chunks_error(r, 'worst'):+.1%}) | "
            f"{_band(r['band_error'])} ({_band(r['band_worst_error'])}) |")
    return "\n".join(lines)


def _chunks_error(row, step):
    """The chunk figure's error against the `step` ("measured": median, or "worst") peak:
    the figure comparable to TensorFlow's, whose allocator counts chunks."""
    return row["predicted_chunks"] / row[step] - 1


def _band(error):
    return "in" if error == 0 else f"{error:+.1%}"


def summary(rows, target=0.10, worst_target=0.15):
    """One line: how many configurations meet the accuracy targets (`target` for the
    median error, `worst_target` for the worst), by either figure."""
    median = sum(abs(r["error"]) <= target for r in rows)
    worst = sum(abs(r["worst_error"]) <= worst_target for r in rows)
    chunks = sum(abs(_chunks_error(r, "measured")) <= target for r in rows)
    chunks_worst = sum(abs(_chunks_error(r, "worst")) <= worst_target for r in rows)
    band = sum(abs(r["band_error"]) <= target for r in rows)
    band_worst = sum(abs(r["band_worst_error"]) <= worst_target for r in rows)
    return (f"RESULT: of {len(rows)} configurations, the requested-bytes figure is within "
            f"{target:.0%} of the median step in {median} and within {worst_target:.0%} of "
            f"the worst step in {worst}; the chunk figure in {chunks} and {chunks_worst}; "
            f"the band (requested to chunks) within {target:.0%} of the median in {band} and "
            f"within {worst_target:.0%} of the worst in {band_worst}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        models, sizes, steps = json.loads(argv[1]), json.loads(argv[2]), int(argv[3])
        _worker(models, sizes, steps, argv[4] == "1")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write every figure and the provenance to this file")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help="kernel paths to measure (comma-separated: eigen,onednn)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="allocator layouts to measure (comma-separated: grown: regions "
                             "grown on demand; one-region: the memory reserved as one region "
                             "first, as a GPU holds it)")
    args = parser.parse_args(argv)
    from tfmem.cli import provenance  # pylint: disable=import-outside-toplevel
    from tfmem.cli.child_env import kernel_path  # pylint: disable=import-outside-toplevel
    paths = {p: PATHS[p] for p in args.paths.split(",")}
    layouts = args.layouts.split(",")
    rows = run(paths, layouts={name: (None, SIZES) for name in layouts})
    for row in rows:
        print(line(row))
    result = summary(rows)
    print(result)
    if args.json:
        data = dict(kind="simulator-accuracy", rows=rows, result=result, models=MODELS,
                    sizes=list(SIZES), steps=STEPS, layouts=layouts,
                    provenance=provenance.provenance(
                        {p: kernel_path(onednn) for p, onednn in paths.items()}))
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
