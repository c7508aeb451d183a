"""Peak spread: how much TensorFlow's own peak for one step varies from process to process.

    python experiments/peak_spread.py            # 5 fresh processes per model and kernel path
    python experiments/peak_spread.py --quick    # 3
    python experiments/peak_spread.py --json experiments/results/peak_spread.json
    python experiments/peak_spread.py --shared-process --json experiments/results/peak_spread-shared.json
    python experiments/peak_spread.py --models resnet moe pool --ordered --json experiments/results/peak_spread-ordered.json

Each process pays TensorFlow's start (10-20 s on a loaded 2-core machine): the
default's 60 processes took 22 min at a load average of 6, --shared-process
(10 processes) under 4 min.

Issue 10 asks for a predicted device peak within 10 % of TensorFlow's measured
one.  The measurement itself is not one number: the same plan has read 4.0,
5.1 or 5.9 MiB (the oneDNN pool net) and 15.3 to 19.0 MiB (the Eigen MoE
layer) in different processes.  This experiment
measures that spread without tfmem in the way: for each of the simulator
accuracy suite's models (`MODELS` of experiments/accuracy.py, the measurement
tests/test_simulate.py runs, read from that file so that both stay the same)
and each kernel path (TF_ENABLE_ONEDNN_OPTS=0 and =1), it trains the model with a PLAIN `tf.compat.v1.Session` in N fresh
processes and takes, per process, the median of TensorFlow's allocator peak
over steps 2..6 (the first step warms caches; the peak is reset before each
step in this measuring process only).  Every process has:

* TensorFlow's BFC allocator limited far above the step
  (`tfmem.cli.child_env`: figures on every kernel path, no cap);
* pinned thread pools (1 intra-op, 1 inter-op thread), so the figures do not
  depend on the machine's core count;
* the kernel path set explicitly.

Each figure is less what the allocator held beyond the model's variables when
the step started (what the initializer left, as the accuracy test does).

After its plain steps each process also asks tfmem for the one-partition
plan's two predicted figures (`device_peak`, bytes requested; and
`device_peak_chunks`, the same allocations replayed in BFC chunks), which
calibrate kernel scratch in a scratch session and run no step.

With `--shared-process`, each of the N processes per kernel path runs every
model in turn, in the suite's order, each in its own graph and session (closed
before the next), as the accuracy test's measuring process does: the
allocator then starts each model with the free chunks the models before it
left.  Comparing both modes separates what the process's history does from
what the executor does in a fresh process.

With `--ordered`, each process runs a copy of the graph in which every op of the
step waits for the one before it in the simulator's depth-first order (control
edges), and the prediction is of that order alone: does the executor's order
explain the spread?

A single predicted figure can be within 10 % of every process's measurement
only if max <= (1.1 / 0.9) x min of the measurements: the `one figure` column
says whether that holds; the last columns whether each predicted figure is
within 10 % of all of them.  Memory, not time, is measured, so the machine's
load matters less; it is recorded anyway (at the start and in the provenance).
"""

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tfmem.cli import child_env, provenance  # noqa: E402  pylint: disable=wrong-import-position

MIB = 1 << 20
PATHS = {"eigen": False, "onednn": True}  # kernel path -> TF_ENABLE_ONEDNN_OPTS
TARGET = 0.10  # issue 10's target for the median step
# A figure p is within TARGET of every m in [low, high] iff high / low <= this.
ONE_FIGURE_RATIO = (1 + TARGET) / (1 - TARGET)
ONE_PARTITION = 100000  # a partition size larger than every model: the whole step
SUITE = os.path.join(ROOT, "experiments", "accuracy.py")


def suite_models(path=SUITE):
    """The accuracy suite's MODELS ({name: (builder, kwargs, batch)}), read from its source
    as literals (the file's other names are not needed here)."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "MODELS" for t in node.targets):
            expression = ast.Expression(node.value)
            # Literals and dict(...) calls only: no other name is available to it.
            return eval(compile(expression, path, "eval"),  # pylint: disable=eval-used
                        {"__builtins__": {}, "dict": dict})
    raise RuntimeError(f"{path} defines no MODELS")


# --------------------------------------------------------------------------
# one process: one model on one kernel path


def chained(graph, order):
    """A copy of `graph` in which each op of `order` waits for the one before it (a
    control edge): TensorFlow's executor can then run them in that order only."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    graph_def = graph.as_graph_def()
    nodes = {node.name: node for node in graph_def.node}
    for before, after in zip(order, order[1:]):
        nodes[after].input.append("^" + before)
    copy = tf.Graph()
    with copy.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return copy


def depth_first_only(view, ops, originals=frozenset()):  # pylint: disable=unused-argument
    """The simulator's orders for a chained partition: the one it was chained in."""
    from tfmem.memory import op_order  # pylint: disable=import-outside-toplevel
    return [op_order.dependency_order(view, ops)]


def worker(name, builder, kwargs, batch, steps, ordered=False):
    """Train `name` with a plain Session for `steps` steps; the figures as a dict.  With
    `ordered`, the Session runs a copy of the graph whose step ops are chained in the
    simulator's depth-first order (`chained`), and the prediction is of that order."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.memory import op_order, simulate  # pylint: disable=import-outside-toplevel
    from tfmem.run import accelerator  # pylint: disable=import-outside-toplevel
    from accuracy import model_session  # pylint: disable=import-outside-toplevel

    # The prediction is of the plain step: chained as TFMemSession chains its copies (no
    # equal ops merged, one kernel at a time) only when the step's ops are chained too.
    options = tfmem.Options(chain_copies=ordered)
    model, sess = model_session(builder, kwargs)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    run_sess, run_feed, run_fetches, init = sess, feed, fetches, model.init
    if ordered:
        simulate.partition_orders = depth_first_only
        plan = tfmem.TFMemSession(sess, partition_size=ONE_PARTITION,
                                  options=options).plan(fetches, feed)
        ops = plan.partitions[0].ops
        graph = chained(model.graph, op_order.dependency_order(plan.view, ops))
        run_sess = tf.compat.v1.Session(graph=graph, config=sess._config)  # pylint: disable=protected-access
        run_feed = {graph.get_tensor_by_name(t.name): v for t, v in feed.items()}
        run_fetches = [graph.get_operation_by_name(model.train.name),
                       graph.get_tensor_by_name(model.loss.name)]
        init = graph.get_operation_by_name(model.init.name)
    run_sess.run(init)
    peaks, resident, seconds = [], [], []
    for _ in range(steps):
        resident.append(accelerator.device_memory("CPU:0")["current"])
        accelerator.reset_peak("CPU:0")  # this measuring process's own figure
        started = time.perf_counter()
        run_sess.run(run_fetches, run_feed)
        seconds.append(time.perf_counter() - started)
        peaks.append(accelerator.device_memory("CPU:0")["peak"])
    # The prediction after the plain steps: its kernel calibration allocates too.
    tfs = tfmem.TFMemSession(sess, partition_size=ONE_PARTITION, options=options)
    trace = tfs.simulate(fetches, feed)
    tfs.close()  # and the session: a next model in this process starts without them
    if ordered:
        run_sess.close()
    state = trace.state_bytes
    own = [p - max(r - state, 0) for p, r in zip(peaks, resident)]
    judged = own[1:]
    part = trace.partitions[0]
    return dict(model=name, peaks=peaks, resident=resident, state_bytes=state,
                step_seconds=statistics.median(seconds[1:]),
                own=own, median=statistics.median(judged), low=min(judged), high=max(judged),
                predicted=trace.peak_device, predicted_chunks=trace.peak_device_chunks,
                scratch=part.scratch, partitions=len(trace.partitions))


# --------------------------------------------------------------------------
# the parent: N processes per model and path, then the spread


def _run_worker(path, names, steps, timeout, ordered=False):
    """The results of one process running the models `names` in turn, one dict each."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", ",".join(names),
           "--steps", str(steps)] + (["--ordered"] if ordered else [])
    env = child_env.child_env(onednn=PATHS[path])
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    try:
        result, proc, tail = child_env.run_json_child(cmd, env, timeout * len(names))
    except subprocess.TimeoutExpired:
        result, failure = None, f"no result within {timeout * len(names)} s"
    else:
        failure = f"{child_env.describe_exit(proc.returncode)}: {tail[-500:]}"
    if result is None:
        return [dict(path=path, model=name, failure=failure) for name in names]
    return [dict(r, path=path) for r in result["models"]]


def _within(figure, measured):
    return all(abs(figure - m) <= TARGET * m for m in measured)


def spread(runs):
    """The row of one model and path from its processes' results."""
    good = [r for r in runs if "failure" not in r]
    row = dict(path=runs[0]["path"], model=runs[0]["model"], processes=len(runs),
               failures=[r["failure"] for r in runs if "failure" in r])
    if not good:
        return row
    medians = [r["median"] for r in good]
    low, high, middle = min(medians), max(medians), statistics.median(medians)
    predicted = sorted({r["predicted"] for r in good})
    chunks = sorted({r["predicted_chunks"] for r in good})
    row.update(medians=medians, min=low, max=high, median=middle,
               spread=(high - low) / middle,
               within_process=max((r["high"] - r["low"]) / r["median"] for r in good),
               step_seconds=statistics.median(r["step_seconds"] for r in good),
               predicted=predicted[-1], predicted_chunks=chunks[-1],
               predictions_agree=len(predicted) == 1 and len(chunks) == 1,
               predicted_values=predicted, predicted_chunks_values=chunks,
               scratch=max(r["scratch"] for r in good),
               one_figure_possible=high <= ONE_FIGURE_RATIO * low,
               requested_within=_within(predicted[-1], medians),
               chunks_within=_within(chunks[-1], medians),
               runs=good)
    return row


def measure(models, paths, processes, steps, jobs, timeout, shared=False, log=print,
            ordered=False):
    """Rows (one per path and model) of `processes` fresh processes each (with `shared`,
    each process runs every model in turn; with `ordered`, chained: see `worker`)."""
    groups = [list(models)] if shared else [[name] for name in models]
    tasks = [(path, names) for path in paths for names in groups for _ in range(processes)]
    results = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_run_worker, path, names, steps, timeout, ordered)
                   for path, names in tasks]
        for result in (r for future in futures for r in future.result()):
            path, name = result["path"], result["model"]
            results.setdefault((path, name), []).append(result)
            shown = (f"failed: {result['failure'][:200]}" if "failure" in result else
                     f"median {result['median'] / MIB:.2f} MiB (steps "
                     f"{', '.join(f'{p / MIB:.2f}' for p in result['own'])}); predicted "
                     f"{result['predicted'] / MIB:.2f} requested, "
                     f"{result['predicted_chunks'] / MIB:.2f} in chunks; step "
                     f"{result['step_seconds'] * 1000:.0f} ms")
            log(f"  {path:>6} {name:>6}: {shown}", flush=True)
    return [spread(results[path, name]) for path in paths for name in models]


def _mib(nbytes):
    return f"{nbytes / MIB:.2f}"


def _yes(flag):
    return "yes" if flag else "**no**"


def markdown(rows):
    """The table of the rows (docs/results.md and the script's output)."""
    lines = ["| model | path | predicted: requested / in chunks (kernel scratch) MiB | "
             "plain TF, median step per process MiB | min - max MiB | spread "
             "(max-min)/median | one figure within 10 % of all? | requested within 10 % | "
             "chunks within 10 % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "medians" not in row:
            lines.append(f"| {row['model']} | {row['path']} | | every process failed: "
                         f"{row['failures'][0][:80]} | | | | | |")
            continue
        medians = ", ".join(_mib(m) for m in row["medians"])
        failed = f" ({len(row['failures'])} failed)" if row["failures"] else ""
        lines.append(
            f"| {row['model']} | {row['path']} | {_mib(row['predicted'])} / "
            f"{_mib(row['predicted_chunks'])} ({_mib(row['scratch'])}) | {medians}{failed} | "
            f"{_mib(row['min'])} - {_mib(row['max'])} | {row['spread']:.1%} | "
            f"{_yes(row['one_figure_possible'])} | {_yes(row['requested_within'])} | "
            f"{_yes(row['chunks_within'])} |")
    return "\n".join(lines)


def verdict(rows):
    """One line: the configurations where no single figure can be within 10 %."""
    impossible = [f"{r['path']} {r['model']} ({r['spread']:.0%})" for r in rows
                  if "medians" in r and not r["one_figure_possible"]]
    measured = sum("medians" in r for r in rows)
    return (f"SPREAD {len(impossible)} of {measured} configurations spread too far for any "
            "single figure to be within 10 % of every process"
            + (f": {', '.join(impossible)}" if impossible else ""))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--processes", type=int, default=None,
                        help="fresh processes per model and kernel path (default 5; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="3 processes each")
    parser.add_argument("--steps", type=int, default=6,
                        help="steps per process; steps 2..N are judged (default 6)")
    parser.add_argument("--models", nargs="+", help="a subset of the suite's models")
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=sorted(PATHS))
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time (default 2)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per process")
    parser.add_argument("--json", help="write every figure and the provenance to this file")
    parser.add_argument("--shared-process", action="store_true",
                        help="each process runs every model in turn (as the accuracy test's)")
    parser.add_argument("--ordered", action="store_true",
                        help="chain each step's ops in the simulator's depth-first order "
                             "(control edges in a copy of the graph) and predict that order")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    models = suite_models()
    if args.worker:
        print(json.dumps({"models": [worker(name, *models[name], args.steps, args.ordered)
                                     for name in args.worker.split(",")]}))
        return 0
    if args.steps < 3:
        parser.error("--steps must be at least 3 (step 1 warms up; a median needs two more)")
    unknown = sorted(set(args.models or ()) - set(models))
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; the suite's: {', '.join(models)}")
    if args.models:
        models = {name: models[name] for name in args.models}
    processes = args.processes or (3 if args.quick else 5)
    load_start = list(os.getloadavg())
    started = time.time()
    print(f"peak spread: {len(models)} models x {len(args.paths)} kernel paths x {processes} "
          + ("processes, each running every model in turn" if args.shared_process else
             "fresh processes each")
          + f", steps 2..{args.steps} judged; load average "
          f"{'/'.join(f'{v:.1f}' for v in load_start)}", flush=True)
    rows = measure(models, args.paths, processes, args.steps, args.jobs, args.timeout,
                   args.shared_process, ordered=args.ordered)
    seconds = time.time() - started
    print()
    print(markdown(rows))
    print()
    line = verdict(rows)
    print(line)
    if args.json:
        data = dict(kind="peak-spread", processes=processes, steps=args.steps,
                    quick=args.quick, jobs=args.jobs, target=TARGET, seconds=seconds,
                    shared_process=args.shared_process, ordered=args.ordered,
                    load_average_start=load_start, result=line, rows=rows,
                    models={name: list(spec) for name, spec in models.items()},
                    provenance=provenance.provenance(
                        {path: child_env.kernel_path(onednn) for path, onednn in PATHS.items()
                         if path in args.paths}))
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1)
            out.write("\n")
        print(f"wrote {args.json}")
    return 0 if all("medians" in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
