"""Benchmark of tfmem's step time, per-partition overhead, planning time and
capped training (issue 6).

    python tools/bench.py [--quick] [--steps N] [--warmup N] [--json OUT.json]
                          [--skip-fits] [--skip-plan] [--skip-capped] [--profile]
                          [--measure-cost]

(a) A model that fits: ResNet-56 (`tfmem.cli.models.resnet(blocks=(9, 9, 9))`,
    batch 32).  One graph, two sessions (plain, and the one tfmem wraps),
    both initialised; per partition size (50, 200, "auto" with a budget far
    above the step's peak, so budget mode should choose one partition) the
    steps alternate plain/tfmem (the order flips every step), warm-up steps
    and tfmem's first (planning + compiling) step are excluded, and medians
    and the ratio tfmem/plain are printed.

    Per-partition overhead: tfmem times every partition call on the step's
    thread and every upload call on its prefetch thread, and reports them in
    the step's StepStats (`call_time`, `uploads`, `upload_time`).  overhead =
    (tfs.run wall time - the step's partition calls) / partitions: everything
    tfmem does on the main thread outside TensorFlow (request building, swap
    manager, the swap-out copies, waits for prefetches, results).  The timing
    itself (two clock reads per call, measured and printed) is counted in the
    overhead.
    A second figure excludes the transfers: the executor loop's time less its
    Session calls, prefetch waits and swap-out copies, from a few extra steps
    run with a Chrome trace after the timed ones (the trace has the swap-out
    copies), plus the untraced steps' time outside the executor.

    Planning: a chain graph of ~100,000 ops (a forward chain and a
    hand-written backward chain that reads every forward activation, so
    transfers span the graph the way a training step's do), imported as one
    GraphDef (building it op by op would take minutes).  `tfs.plan` is timed
    on its first call and again on a second call, which should only look the
    plan up in the cache.

(b) A model that trains only with tfmem: `tfmem.cli.models.mlp(layers=24,
    width=256)` at batch 2048.  Three fresh processes (the emulated cap is
    read when TensorFlow starts): plain peak without a cap (TensorFlow's BFC
    allocator, capped far above the step, so it reports its peak); plain
    under half that peak (must run out of memory); tfmem under the same cap
    (partition_size="auto": the cap is the budget).  tfmem's throughput is
    measured on untraced steps; transfer shares from extra steps with a
    Chrome trace: swap-out copies (main thread) and uploads (prefetch
    thread, overlapping compute) summed over the step, divided by the step's
    wall time; the prefetch wait share is last_step.prefetch_wait_time /
    last_step.wall_time.

(e) With --measure-cost: what reading TensorFlow's allocator figures costs,
    tfmem under a budget with measure="every", "sample" (the default) and
    "off" against plain TensorFlow in one process (tools/measure_cost.py).

Each goal is printed last as one machine-readable line:
`TARGET name=value (goal ...) ok|MISSED`.

Public API only: `TFMemSession.last_step` (StepStats, with the step's call
times), `last_compile` (CompileStats) and `tracing(path)` for the traced
breakdown steps, so the timed steps carry no tracing cost.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import tfmem  # noqa: E402  (imports no TensorFlow: children set the cap first)
from tfmem.cli import child_env, provenance  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import measure_cost  # noqa: E402  (section (e): what measuring steps costs)

MIB = 1 << 20

GOALS = {  # name -> (comparison, bound)
    "fits_ps200_ratio": ("<=", 1.15),
    "auto_ratio": ("<=", 1.02),
    "overhead_ms_per_partition": ("<=", 0.2),
    "plan_100k_s": ("<=", 10.0),
    "cached_plan_s": ("<=", 0.01),
    "prefetch_wait_share": ("<", 0.10),
    "first_step_ps50_ratio": ("<=", 2.0),
    "compile_ratio_50k_2k": ("<=", 1.5),
    "budget_refusal_s": ("<=", 10.0),
    "host_guard_refusal_s": ("<=", 5.0),
}

FULL = dict(steps=20, warmup=3, breakdown_steps=3, capped_steps=10, capped_warmup=2)
QUICK = dict(steps=6, warmup=2, breakdown_steps=2, capped_steps=4, capped_warmup=1)


def _median(values):
    return statistics.median(values) if values else None


def _tf():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf


# --------------------------------------------------------------------------
# timing Session calls: StepStats.call_time, uploads and upload_time (public)


def timer_cost(calls=20000):
    """Seconds tfmem's own timing of a partition call adds to it (two clock reads and a
    sum, as in `tfmem.run.step_loop`; StepStats.call_time), measured on a no-op call."""
    clock = time.perf_counter

    def call():
        return None

    started = clock()
    for _ in range(calls):
        call()
    bare = clock() - started
    total = 0.0
    started = clock()
    for _ in range(calls):
        called = clock()
        call()
        total += clock() - called
    return max((clock() - started - bare) / calls, 0.0)


# --------------------------------------------------------------------------
# Chrome traces


def trace_durations(trace):
    """{track: (events, seconds)} of a Chrome trace written by tfmem (dict or path)."""
    if not isinstance(trace, dict):
        with open(trace, encoding="utf-8") as handle:
            trace = json.load(handle)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M"}
    totals = {}
    for event in trace["traceEvents"]:
        if event.get("ph") != "X":
            continue
        track = names.get(event["tid"], str(event["tid"]))
        count, seconds = totals.get(track, (0, 0.0))
        totals[track] = (count + 1, seconds + event["dur"] * 1e-6)
    return totals


def _traced_steps(tfs, run, steps, path):
    """Run `steps` steps with a Chrome trace; per step the trace's durations and StepStats.

    Traces these steps only (`TFMemSession.tracing`).
    """
    if not hasattr(tfs, "tracing") or steps <= 0:
        return []
    out = []
    with tfs.tracing(path):
        for _ in range(steps):
            run()
            out.append((trace_durations(path), tfs.last_step))
    return out


# --------------------------------------------------------------------------
# (a) a model that fits


def _config(tf, name):
    """The session config of a bench side: "tfmem" (tfmem.session_config) or "default"."""
    config = tf.compat.v1.ConfigProto()
    return tfmem.session_config(config) if name == "tfmem" else config


def _session(tf, graph, config="default"):
    return tf.compat.v1.Session(graph=graph, config=_config(tf, config))


def _request_ops(tfs, fetches, feed):
    plan = tfs.plan(fetches, feed)
    return plan.num_ops


def bench_fits(blocks=(9, 9, 9), batch=32, partition_sizes=(50, 200, "auto"), steps=10,
               warmup=2, budget="8GiB", breakdown_steps=2, width=16, image=32, swap="auto",
               tfmem_config="tfmem", partial_runs=False, log=None):
    """Plain vs tfmem on one graph in this process; a dict with one entry per partition size.

    The plain session has TensorFlow's default config; tfmem's has `tfmem_config`.
    """
    log = log or (lambda text: None)
    tf = _tf()
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    started = time.perf_counter()
    model = models.resnet(blocks=blocks, width=width, image=image)
    build_s = time.perf_counter() - started
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    plain = _session(tf, model.graph)
    wrapped = _session(tf, model.graph, tfmem_config)
    plain.run(model.init)
    wrapped.run(model.init)
    started = time.perf_counter()
    plain.run(fetches, feed)  # plain's first step, on the user's graph alone
    plain_first_s = time.perf_counter() - started
    depth = 6 * blocks[0] + 2 if len(set(blocks)) == 1 else None
    result = dict(model=f"ResNet-{depth}" if depth else f"ResNet blocks={blocks}",
                  blocks=list(blocks), batch=batch, width=width, image=image,
                  graph_ops=len(model.graph.get_operations()), build_s=build_s,
                  steps=steps, warmup=warmup, swap=swap, timer_cost_us=timer_cost() * 1e6,
                  tfmem_config=tfmem_config, plain_first_step_s=plain_first_s, configs=[])
    log(f"(a) {result['model']}, batch {batch}: graph of {result['graph_ops']} ops built in "
        f"{build_s:.1f} s")
    trace_dir = tempfile.mkdtemp(prefix="tfmem-bench-")
    for size in partition_sizes:
        kwargs = dict(device_memory_budget=budget) if size == "auto" else {}
        tfs = tfmem.TFMemSession(wrapped, partition_size=size, swap=swap,
                                 partial_runs=partial_runs, **kwargs)
        t0 = time.perf_counter()
        tfs.run(fetches, feed)  # plans, rewrites, compiles
        first_s = time.perf_counter() - t0
        compiled = tfs.last_compile
        first_step = tfs.last_step
        plain.run(fetches, feed)  # the plain session extends itself to the grown graph
        for _ in range(warmup):
            plain.run(fetches, feed)
            tfs.run(fetches, feed)
        plain_times, tfmem_times, plain_cpu, tfmem_cpu, rows = [], [], [], [], []
        for i in range(steps):
            order = ("plain", "tfmem") if i % 2 == 0 else ("tfmem", "plain")
            for which in order:
                if which == "plain":
                    c0, t0 = time.process_time(), time.perf_counter()
                    plain.run(fetches, feed)
                    plain_times.append(time.perf_counter() - t0)
                    plain_cpu.append(time.process_time() - c0)
                else:
                    c0, t0 = time.process_time(), time.perf_counter()
                    tfs.run(fetches, feed)
                    wall = time.perf_counter() - t0
                    tfmem_cpu.append(time.process_time() - c0)
                    step = tfs.last_step  # its partition and upload calls, timed by tfmem
                    tfmem_times.append(wall)
                    rows.append(dict(wall=wall, executor=step.wall_time, calls=step.partitions,
                                     call_s=step.call_time, uploads=step.uploads,
                                     upload_s=step.upload_time, wait=step.prefetch_wait_time))
        stats = tfs.last_step
        parts = stats.partitions
        # Traced steps (after the timed ones): the swap-out copies' time, and the
        # executor loop's own time less Session calls, waits and swap-out copies,
        # all from the same step.
        traced = _traced_steps(tfs, lambda: tfs.run(fetches, feed), breakdown_steps,
                               os.path.join(trace_dir, f"fits_{size}.json"))
        swap_outs = [d.get("swap-out", (0, 0.0))[1] for d, _ in traced]
        swap_out_s = _median(swap_outs)
        loop_excl = [s.wall_time - s.call_time - s.prefetch_wait_time - o
                     for (_, s), o in zip(traced, swap_outs)]
        plain_med, tfmem_med = _median(plain_times), _median(tfmem_times)
        overhead = [(r["wall"] - r["call_s"]) / parts for r in rows]
        loop_overhead = [(r["executor"] - r["call_s"]) / parts for r in rows]
        outside = [r["wall"] - r["executor"] for r in rows]
        # untraced time outside the executor (request, results) + the traced loop's own time
        excl = ((_median(outside) + _median(loop_excl)) / parts) if loop_excl else None
        config = dict(
            partition_size=size, partitions=parts, first_step_s=first_s,
            first_step_ratio=first_s / plain_first_s,
            compile=dict(plan_s=compiled.plan_time, simulate_s=compiled.simulate_time,
                         rewrite_s=compiled.rewrite_time, extend_s=compiled.extend_time,
                         callables_s=compiled.callables_time, callables=compiled.callables,
                         setup_s=first_step.setup_time, partial_run=first_step.partial_run,
                         graph_ops_before=compiled.graph_ops_before,
                         graph_ops_after=compiled.graph_ops_after),
            request_ops=_request_ops(tfs, fetches, feed),
            plain_ms=plain_med * 1e3, tfmem_ms=tfmem_med * 1e3, ratio=tfmem_med / plain_med,
            paired_ratio=_median([t / p for t, p in zip(tfmem_times, plain_times)]),
            plain_cpu_ms=_median(plain_cpu) * 1e3, tfmem_cpu_ms=_median(tfmem_cpu) * 1e3,
            cpu_ratio=_median(tfmem_cpu) / _median(plain_cpu),
            plain_times_ms=[t * 1e3 for t in plain_times],
            tfmem_times_ms=[t * 1e3 for t in tfmem_times],
            calls_ms=_median([r["call_s"] for r in rows]) * 1e3,
            uploads=rows[-1]["uploads"] if rows else 0,
            upload_ms=_median([r["upload_s"] for r in rows]) * 1e3,
            prefetch_wait_ms=_median([r["wait"] for r in rows]) * 1e3,
            swap_out_ms=None if swap_out_s is None else swap_out_s * 1e3,
            outside_executor_ms=_median(outside) * 1e3,
            overhead_ms_per_partition=_median(overhead) * 1e3,
            loop_overhead_ms_per_partition=_median(loop_overhead) * 1e3,
            overhead_excl_transfers_ms_per_partition=None if excl is None else excl * 1e3,
            swapped_out=stats.swapped_out, swapped_out_mib=stats.swapped_out_bytes / MIB,
            swapped_in=stats.swapped_in, peak_device_handles=stats.peak_device_handles)
        result["configs"].append(config)
        log(f"    partition_size={size}: {parts} partitions, plain {config['plain_ms']:.0f} ms, "
            f"tfmem {config['tfmem_ms']:.0f} ms ({config['ratio']:.2f}x); first step "
            f"{first_s:.1f} s")
    plain.close()
    wrapped.close()
    shutil.rmtree(trace_dir, ignore_errors=True)
    return result


# --------------------------------------------------------------------------
# planning a ~100k-op graph


def chain_graph(n_ops=100_000, width=8):
    """A ~n_ops-op graph: forward chain, then a backward chain reading every activation.

    Per layer, forward: MatMul, Relu, Mul, AddV2; backward: Mul, ReluGrad,
    MatMul(transpose_b).  Built as one GraphDef and imported.  Returns
    (graph, x placeholder, loss tensor).
    """
    tf = _tf()
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(chain_graph_def(n_ops, width), name="")
    return graph, graph.get_tensor_by_name("x:0"), graph.get_tensor_by_name("loss:0")


def chain_graph_def(n_ops, width=8):
    """The GraphDef of `chain_graph` (about n_ops nodes)."""
    tf = _tf()
    import numpy as np  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    layers = max(1, (n_ops - 6) // 7)
    graph_def = tf1.GraphDef()
    dtype = tf1.AttrValue(type=tf.float32.as_datatype_enum)

    def node(name, op, inputs=(), **attrs):
        new = graph_def.node.add(name=name, op=op)
        new.input.extend(inputs)
        for key, value in attrs.items():
            new.attr[key].CopyFrom(value)

    def const(name, value):
        node(name, "Const", dtype=tf1.AttrValue(type=tf.as_dtype(value.dtype).as_datatype_enum),
             value=tf1.AttrValue(tensor=tf.make_tensor_proto(value)))

    node("x", "Placeholder", dtype=dtype,
         shape=tf1.AttrValue(shape=tf.TensorShape([None, width]).as_proto()))
    const("w", np.eye(width, dtype=np.float32) / 1.5)
    const("half", np.float32(0.5))
    const("axes", np.array([0, 1], dtype=np.int32))
    h, acts = "x", []
    for i in range(layers):
        node(f"f{i}/mm", "MatMul", [h, "w"], T=dtype)
        node(f"f{i}/relu", "Relu", [f"f{i}/mm"], T=dtype)
        node(f"f{i}/mul", "Mul", [f"f{i}/relu", "half"], T=dtype)
        node(f"f{i}/add", "AddV2", [f"f{i}/mul", f"f{i}/relu"], T=dtype)
        acts.append(f"f{i}/relu")
        h = f"f{i}/add"
    node("seed", "OnesLike", [h], T=dtype)
    grad = "seed"
    for i in reversed(range(layers)):
        node(f"b{i}/scale", "Mul", [grad, "half"], T=dtype)
        node(f"b{i}/relugrad", "ReluGrad", [f"b{i}/scale", acts[i]], T=dtype)
        node(f"b{i}/mm", "MatMul", [f"b{i}/relugrad", "w"], T=dtype,
             transpose_b=tf1.AttrValue(b=True))
        grad = f"b{i}/mm"
    node("loss", "Sum", [grad, "axes"], T=dtype,
         Tidx=tf1.AttrValue(type=tf.int32.as_datatype_enum))
    return graph_def


def bench_plan(n_ops=100_000, partition_size=200, log=None):
    """First and cached `tfs.plan` time on a chain graph of ~n_ops ops."""
    log = log or (lambda text: None)
    tf = _tf()
    import numpy as np  # pylint: disable=import-outside-toplevel
    started = time.perf_counter()
    graph, x, loss = chain_graph(n_ops)
    build_s = time.perf_counter() - started
    sess = _session(tf, graph)
    tfs = tfmem.TFMemSession(sess, partition_size=partition_size)
    feed = {x: np.ones((4, 8), np.float32)}
    started = time.perf_counter()
    plan = tfs.plan(loss, feed)
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    again = tfs.plan(loss, feed)
    cached_s = time.perf_counter() - started
    sess.close()
    result = dict(graph_ops=len(graph.get_operations()), request_ops=plan.num_ops,
                  build_s=build_s, partition_size=partition_size, plan_s=first_s,
                  cached_s=cached_s, cached_same_plan=again is plan,
                  partitions=len(plan.partitions), transfers=len(plan.transfers))
    log(f"(a) planning: {result['request_ops']} ops: first plan {first_s:.1f} s, "
        f"cached {cached_s * 1e3:.2f} ms")
    return result


# --------------------------------------------------------------------------
# (c) the first step against the size of the session graph


def bench_first_step(graph_ops=(2000, 10_000, 50_000), partition_sizes=(20, 50, 200),
                     configs=("tfmem", "default"), default_sizes=None, layers=16, batch=32,
                     partial_runs=False, log=None):
    """tfmem's first step of one fixed request, in session graphs of growing size.

    The request is an MLP training step (`models.mlp(layers, width=64)`); the
    user's graph is filled up to `graph_ops` with a chain graph the request
    does not touch.  Per config and size: plain's first step of the request on
    a fresh session with that config, then tfmem's, split by
    `TFMemSession.last_compile`.  "tfmem": one `tfmem.Session` per partition
    size (its config, and a session graph holding only what requests reach);
    "default": one TFMemSession per partition size wrapping one session of
    TensorFlow's default config on the user's graph (each plan's copies add to
    that graph: the row says its size at compile time).  `default_sizes`: the
    partition sizes run with the default config (None: all).
    """
    log = log or (lambda text: None)
    tf = _tf()
    tf1 = tf.compat.v1
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    rows = []
    for config in configs:
        sizes = partition_sizes if config == "tfmem" or default_sizes is None else default_sizes
        for target in graph_ops:
            model = models.mlp(layers=layers, width=64, features=64)
            filler = target - model.graph.version
            if filler > 0:
                with model.graph.as_default():
                    tf.graph_util.import_graph_def(chain_graph_def(filler), name="filler")
            feed = model.feed(batch)
            fetches = [model.train, model.loss]
            plain = _session(tf, model.graph, config)
            plain.run(model.init)
            started = time.perf_counter()
            plain.run(fetches, feed)
            plain_first_s = time.perf_counter() - started
            plain.close()
            own = config == "tfmem"  # tfmem.Session per size, else one session wrapped by all
            if not own:
                wrapped = _session(tf, model.graph, config)
                wrapped.run(model.init)
            for size in sizes:
                if own:  # a session of its own, on a copy of what it reaches
                    tfs = tfmem.Session(graph=model.graph, partition_size=size,
                                        partial_runs=partial_runs)
                    tfs.run(model.init)
                else:  # the user's session, wrapped: its graph is the whole user graph
                    tfs = tfmem.TFMemSession(wrapped, partition_size=size,
                                             partial_runs=partial_runs)
                started = time.perf_counter()
                tfs.run(fetches, feed)
                first_s = time.perf_counter() - started
                c = tfs.last_compile
                plan = tfs.plan(fetches, feed)
                parts = len(plan.partitions)
                row = dict(config=config, graph_ops=target, user_graph_ops=model.graph.version,
                           session_graph_ops=c.graph_ops_before,
                           added_ops=c.graph_ops_after - c.graph_ops_before,
                           request_ops=plan.num_ops, partition_size=size,
                           partitions=parts, callables=c.callables, copy_s=c.copy_time,
                           plan_s=c.plan_time,
                           simulate_s=c.simulate_time, rewrite_s=c.rewrite_time,
                           extend_s=c.extend_time,
                           callables_s=c.callables_time,
                           ms_per_callable=c.callables_time / max(c.callables, 1) * 1e3,
                           # a partial run's one executor, built by its first setup
                           setup_s=tfs.last_step.setup_time,
                           partial_run=tfs.last_step.partial_run,
                           ms_per_partition=(c.callables_time + tfs.last_step.setup_time)
                           / max(parts, 1) * 1e3,
                           first_run_s=tfs.last_step.wall_time, first_step_s=first_s,
                           plain_first_step_s=plain_first_s)
                rows.append(row)
                if own:
                    tfs.close()
                log(f"(c) {config} config, {c.graph_ops_before} ops in the session graph, "
                    f"partition_size={size}: {parts} partitions, {c.callables} callables "
                    f"{row['ms_per_callable']:.0f} ms each, setup {row['setup_s']:.2f} s, "
                    f"first step {first_s:.1f} s "
                    f"(plain {plain_first_s:.2f} s)")
            if not own:
                wrapped.close()
    return dict(layers=layers, batch=batch, rows=rows)


def first_step_targets(first):
    """{name: value}: per-partition compile cost (callables, and a partial run's setup,
    which builds one executor for all partitions) at the largest graph over the
    smallest, at ps 50."""
    values = {}
    for config in ("tfmem", "default"):
        rows = {r["graph_ops"]: r for r in first["rows"]
                if r["config"] == config and r["partition_size"] == 50}
        if len(rows) > 1:
            low, high = rows[min(rows)], rows[max(rows)]
            name = "compile_ratio" if config == "tfmem" else "compile_ratio_default_config"
            values[f"{name}_{high['graph_ops'] // 1000}k_{low['graph_ops'] // 1000}k"] = \
                high["ms_per_partition"] / low["ms_per_partition"]
    return values


# --------------------------------------------------------------------------
# (b) a model that trains only with tfmem, in capped subprocesses


def child(kind, cap_mib, layers, width, batch, steps, warmup, breakdown_steps, partition_size):
    """One capped run in this (fresh) process: kind is peak, plain or tfmem. Returns a dict."""
    tfmem.emulate_accelerator(cap_mib)  # before TensorFlow is imported
    tf = _tf()
    from tfmem.run import accelerator  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.mlp(layers=layers, width=width)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    sess = _session(tf, model.graph)
    sess.run(model.init)
    accelerator.reset_peak("CPU:0")
    out = dict(kind=kind, cap_mib=cap_mib, oom=False, error=None, step_times=[], peak_bytes=0)
    if kind in ("peak", "plain"):
        runner = sess
    else:
        size = partition_size if partition_size == "auto" else int(partition_size)
        runner = tfmem.TFMemSession(sess, partition_size=size)
    peak = 0
    try:
        for i in range(warmup + steps):
            started = time.perf_counter()
            runner.run(fetches, feed)
            elapsed = time.perf_counter() - started
            memory = accelerator.device_memory("CPU:0")
            peak = max(peak, memory["peak"] if memory else 0)
            if i >= warmup:
                out["step_times"].append(elapsed)
                if kind == "tfmem":
                    s = runner.last_step
                    out.setdefault("waits", []).append(s.prefetch_wait_time)
                    out.setdefault("walls", []).append(s.wall_time)
    except tf.errors.ResourceExhaustedError as err:
        out["oom"] = True
        lines = [line.strip() for line in str(err.message).splitlines() if line.strip()]
        out["error"] = next((line for line in lines if line.startswith("OOM")), lines[0])
    out["peak_bytes"] = peak
    if kind == "tfmem" and not out["oom"]:
        s = runner.last_step
        out.update(partitions=s.partitions, swapped_out=s.swapped_out,
                   swapped_out_bytes=s.swapped_out_bytes, swapped_in=s.swapped_in,
                   swapped_in_bytes=s.swapped_in_bytes, last_step=str(s))
        trace_dir = tempfile.mkdtemp(prefix="tfmem-bench-")
        traced = _traced_steps(runner, lambda: runner.run(fetches, feed), breakdown_steps,
                               os.path.join(trace_dir, "capped.json"))
        shutil.rmtree(trace_dir, ignore_errors=True)
        out["traced"] = [dict(wall=s.wall_time, wait=s.prefetch_wait_time,
                              tracks={k: list(v) for k, v in d.items()}) for d, s in traced]
    return out


def _run_child(kind, cap_mib, settings, timeout=900):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--cap", str(cap_mib),
           "--child-settings", json.dumps(settings)]
    # The user's kernel path if set, else oneDNN off: its kernels crash at a full capped allocator
    # instead of raising ResourceExhaustedError (see tfmem/cli/child_env.py).
    env = child_env.self_capping_env(child_env.onednn_from_env(default=False))
    started = time.perf_counter()
    out, proc, tail = child_env.run_json_child(cmd, env, timeout)
    if out is None:
        return dict(kind=kind, failed=True, returncode=proc.returncode, stderr_tail=tail)
    out["failed"] = False
    out["process_s"] = time.perf_counter() - started
    return out


def summarize_capped(run, batch):
    """Throughput and transfer shares of a capped tfmem run (the child's dict)."""
    median = _median(run["step_times"])
    shares, exposed = [], []
    for step in run.get("traced", []):
        tracks = step["tracks"]
        swap_out = tracks.get("swap-out", (0, 0.0))[1]
        upload = tracks.get("prefetch", (0, 0.0))[1]
        shares.append((swap_out + upload) / step["wall"])
        exposed.append((swap_out + step["wait"]) / step["wall"])
    waits = [w / t for w, t in zip(run.get("waits", []), run.get("walls", []))]
    return dict(step_ms=median * 1e3 if median else None,
                throughput=batch / median if median else None,
                transfer_share=_median(shares), exposed_transfer_share=_median(exposed),
                prefetch_wait_share=_median(waits))


def bench_capped(layers=24, width=256, batch=2048, steps=4, warmup=1, breakdown_steps=2,
                 partition_size="auto", fallback=50, log=None):
    """Plain peak, plain under half of it, tfmem under half of it: three processes."""
    log = log or (lambda text: None)
    settings = dict(layers=layers, width=width, batch=batch, steps=steps, warmup=warmup,
                    breakdown_steps=breakdown_steps, partition_size=partition_size)
    result = dict(model=f"MLP {layers}x{width}", **settings)
    peak = _run_child("peak", 16384, dict(settings, steps=2, warmup=1))
    result["plain_uncapped"] = peak
    if peak["failed"] or not peak["peak_bytes"]:
        log("(b) plain peak run failed:\n" + peak.get("stderr_tail", ""))
        return result
    cap = int(peak["peak_bytes"] / MIB / 2)
    result["plain_peak_mib"] = peak["peak_bytes"] / MIB
    result["cap_mib"] = cap
    log(f"(b) {result['model']}, batch {batch}: plain peak {result['plain_peak_mib']:.1f} MiB, "
        f"cap {cap} MiB")
    result["plain_capped"] = _run_child("plain", cap, dict(settings, steps=1, warmup=0))
    run = _run_child("tfmem", cap, settings)
    if not run["failed"] and run["oom"] and fallback and partition_size != fallback:
        # Budget mode plans to the cap less 10 %; where the simulator underestimates the
        # measured peak (docs/results.md: the MLP) a step can still run out: say so, then measure
        # a fixed partition size with room to spare.
        result["oom_at"] = dict(partition_size=partition_size, error=run["error"])
        log(f"    tfmem partition_size={partition_size} ran out of memory under the cap; "
            f"measuring partition_size={fallback}")
        result["partition_size"] = fallback
        run = _run_child("tfmem", cap, dict(settings, partition_size=fallback))
    result["tfmem_capped"] = run
    if not run["failed"] and not run["oom"]:
        result.update(summarize_capped(run, batch))
        result["tfmem_peak_mib"] = run["peak_bytes"] / MIB
    return result


# --------------------------------------------------------------------------
# profile


def profile_fits(blocks=(9, 9, 9), batch=32, partition_sizes=(50, 200), steps=5, top=18,
                 log=print):
    """cProfile of tfmem steps (after 3 unprofiled ones); prints the top functions.

    For native frames (inside TensorFlow) run the bench under py-spy instead:
    `py-spy record --native -o spy.svg -- python tools/bench.py --profile ...`.
    """
    import cProfile  # pylint: disable=import-outside-toplevel
    import io  # pylint: disable=import-outside-toplevel
    import pstats  # pylint: disable=import-outside-toplevel
    tf = _tf()
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.resnet(blocks=blocks)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    sess = _session(tf, model.graph)
    sess.run(model.init)
    out = {}
    for size in partition_sizes:
        tfs = tfmem.TFMemSession(sess, partition_size=size)
        for _ in range(3):
            tfs.run(fetches, feed)
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            tfs.run(fetches, feed)
        profiler.disable()
        wall = time.perf_counter() - started
        stream = io.StringIO()
        stats = pstats.Stats(profiler, stream=stream)
        stats.sort_stats("tottime").print_stats(top)
        raw = stats.stats  # pylint: disable=no-member
        tf_s = sum(v[2] for k, v in raw.items() if "TF_SessionRunCallable" in k[2])
        out[size] = dict(wall_s=wall, tf_call_s=tf_s, steps=steps,
                         partitions=tfs.last_step.partitions)
        log(f"--- cProfile, partition_size={size}, {steps} steps, "
            f"{tfs.last_step.partitions} partitions: wall {wall:.2f} s, in "
            f"TF_SessionRunCallable {tf_s:.2f} s ({tf_s / wall:.0%}), Python "
            f"{(wall - tf_s) / steps / tfs.last_step.partitions * 1e3:.3f} ms/partition "
            f"(profiled)")
        log("\n".join(stream.getvalue().splitlines()[:top + 12]))
    sess.close()
    return out


# --------------------------------------------------------------------------
# report


def bench_refusals(huge=100_000):
    """Seconds until a request is refused before anything runs: a budget nothing fits
    (BudgetError, while planning), and swapped tensors the host cannot hold
    (HostMemoryError, before the first partition).  In this process, no cap needed."""
    tf = _tf()
    tf1 = tf.compat.v1
    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    result = {}
    model = models.mlp(layers=12)
    with tf1.Session(graph=model.graph) as sess:
        tfs = tfmem.TFMemSession(sess, device_memory_budget="4MiB")
        sess.run(model.init)
        started = time.perf_counter()
        try:
            tfs.run([model.train, model.loss], model.feed(1024))
            result["budget_refusal"] = None
        except tfmem.BudgetError:
            result["budget_refusal"] = time.perf_counter() - started
    graph = tf.Graph()
    with graph.as_default():
        a = tf.ones([huge, huge])  # 40 GB of float32: a static shape, never materialised
        b = tf.add(a, 1.0)
        total = tf.reduce_sum(tf.add(tf.add(tf.cos(tf.sin(b)), a), b))
    with tf1.Session(graph=graph) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=1, swap="all")
        started = time.perf_counter()
        try:
            tfs.run(total)
            result["host_guard_refusal"] = None
        except tfmem.HostMemoryError:
            result["host_guard_refusal"] = time.perf_counter() - started
    return result


def targets(results):
    """[(name, value)] of the machine-readable figures."""
    values = {}
    fits = results.get("fits")
    if fits:
        by_size = {c["partition_size"]: c for c in fits["configs"]}
        for size, config in by_size.items():
            key = "auto_ratio" if size == "auto" else f"fits_ps{size}_ratio"
            values[key] = config["ratio"]
        numeric = [c for c in fits["configs"] if c["partition_size"] != "auto"]
        if numeric:
            most = max(numeric, key=lambda c: c["partitions"])
            values["overhead_ms_per_partition"] = most["overhead_ms_per_partition"]
            values["overhead_excl_transfers_ms_per_partition"] = \
                most["overhead_excl_transfers_ms_per_partition"]
        for config in fits["configs"]:
            if config["partition_size"] == "auto":
                values["auto_partitions"] = config["partitions"]
            else:
                values[f"first_step_ps{config['partition_size']}_ratio"] = \
                    config["first_step_ratio"]
    plan = results.get("plan")
    if plan:
        values["plan_100k_s" if plan["request_ops"] >= 90_000 else
               f"plan_{plan['request_ops'] // 1000}k_s"] = plan["plan_s"]
        values["cached_plan_s"] = plan["cached_s"]
    if results.get("first_step"):
        values.update(first_step_targets(results["first_step"]))
    capped = results.get("capped")
    if capped:
        plain = capped.get("plain_capped") or {}
        values["capped_plain"] = "OOM" if plain.get("oom") else (
            "failed" if plain.get("failed", True) else "fits")
        if capped.get("throughput"):
            values["capped_tfmem_examples_per_s"] = capped["throughput"]
            values["transfer_share"] = capped["transfer_share"]
            values["prefetch_wait_share"] = capped["prefetch_wait_share"]
        else:
            values["capped_tfmem_examples_per_s"] = "failed"
    refusals = results.get("refusals")
    if refusals:
        for key in ("budget_refusal", "host_guard_refusal"):
            values[f"{key}_s"] = refusals[key] if refusals[key] is not None else "not refused"
    return list(values.items())


def _target_line(name, value):
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    goal = GOALS.get(name)
    if goal is None:
        return f"TARGET {name}={text} (info)"
    op, bound = goal
    if not isinstance(value, (int, float)):
        return f"TARGET {name}={text} (goal {op} {bound:g}) MISSED"
    ok = value <= bound if op == "<=" else value < bound
    return f"TARGET {name}={text} (goal {op} {bound:g}) {'ok' if ok else 'MISSED'}"


def _fmt(value, width, digits):
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def report(results, out=print):
    """The compact report, then one TARGET line per figure."""
    env = results["env"]
    out(f"tfmem bench: TensorFlow {env['tensorflow']}, Python {env['python']}, "
        f"{env['cpus']} CPUs, {env['mode']}, load average at start {env['loadavg']}")
    fits = results.get("fits")
    if fits:
        out(f"\n(a) fits: {fits['model']} (blocks {tuple(fits['blocks'])}, width "
            f"{fits['width']}, {fits['image']}x{fits['image']}), batch {fits['batch']}, "
            f"swap={fits['swap']!r}; "
            f"one graph, two sessions; {fits['steps']} steps per side after "
            f"{fits['warmup']} warm-up, alternating")
        out(f"{'part.size':>9} {'parts':>5} {'ops':>5} {'plain ms':>8} {'tfmem ms':>8} "
            f"{'ratio':>6} {'paired':>6} {'cpu':>5} {'ovh/part':>8} {'excl.xfer':>9} "
            f"{'in TF ms':>8} "
            f"{'wait ms':>7} {'swapout':>7} {'first s':>7}")
        for c in fits["configs"]:
            swap = f"{c['swap_out_ms']:.1f}" if c["swap_out_ms"] is not None else "n/a"
            out(f"{str(c['partition_size']):>9} {c['partitions']:>5} {c['request_ops']:>5} "
                f"{c['plain_ms']:>8.1f} {c['tfmem_ms']:>8.1f} {c['ratio']:>6.3f} "
                f"{c['paired_ratio']:>6.3f} {c['cpu_ratio']:>5.2f} "
                f"{c['overhead_ms_per_partition']:>8.3f} "
                f"{_fmt(c['overhead_excl_transfers_ms_per_partition'], 9, 3)} "
                f"{c['calls_ms']:>8.1f} "
                f"{c['prefetch_wait_ms']:>7.1f} {swap:>7} {c['first_step_s']:>7.1f}")
        out("  ratio: median tfmem / median plain wall time; paired: median of per-step ratios "
            "(adjacent steps); cpu: the same for process CPU time (less sensitive to other load)")
        out("  ovh/part: (tfs.run wall - partition Session calls) / partitions, ms; excl.xfer: "
            "the same less prefetch waits and swap-out copies (loop time from traced steps);")
        out("  in TF: partition Session calls per step, ms;")
        out("  swapout: ms/step copying swapped tensors to host (traced steps); first s: "
            "planning + rewrite + compile + first step")
        for c in fits["configs"]:
            if c["swapped_out"]:
                out(f"  partition_size={c['partition_size']}: swapped out {c['swapped_out']} "
                    f"({c['swapped_out_mib']:.1f} MiB) per step, {c['uploads']} upload calls "
                    f"({c['upload_ms']:.1f} ms on the prefetch thread), handles peak "
                    f"{c['peak_device_handles']}")
        out(f"  timer cost {fits['timer_cost_us']:.2f} us per Session call (counted as overhead)")
        out(f"  first step (tfmem session config {fits['tfmem_config']!r}; plain: TensorFlow's "
            f"default config, {fits['plain_first_step_s']:.1f} s):")
        for c in fits["configs"]:
            k = c["compile"]
            out(f"    partition_size={c['partition_size']}: {c['first_step_s']:.1f} s "
                f"({c['first_step_ratio']:.2f}x plain's): planning {k['plan_s']:.1f} s, "
                f"prediction {k['simulate_s']:.1f} s, rewrite {k['rewrite_s']:.1f} s, "
                f"extend {k['extend_s']:.1f} s, "
                f"{k.get('callables', c['partitions'])} callables {k['callables_s']:.1f} s, "
                + (f"partial-run setup {k['setup_s']:.1f} s, " if k.get("partial_run") else "")
                + f"graph {k['graph_ops_before']} -> "
                f"{k['graph_ops_after']} ops")
    plan = results.get("plan")
    if plan:
        out(f"\n(a) planning: chain graph of {plan['graph_ops']} ops ({plan['request_ops']} in "
            f"the request, built in {plan['build_s']:.1f} s), partition_size "
            f"{plan['partition_size']}: first tfs.plan {plan['plan_s']:.2f} s -> "
            f"{plan['partitions']} partitions, {plan['transfers']} transfers; second call "
            f"{plan['cached_s'] * 1e3:.2f} ms (same plan object: {plan['cached_same_plan']})")
    first = results.get("first_step")
    if first:
        report_first_step(first, out)
    capped = results.get("capped")
    if capped:
        out(f"\n(b) capped: {capped['model']}, batch {capped['batch']}, one process per run, "
            f"kernel path: {_kernel_path(results)}")
        peak = capped.get("plain_uncapped", {})
        if "cap_mib" not in capped:
            out(f"  plain peak run failed: {peak.get('stderr_tail', '')}")
        else:
            out(f"  plain, no cap:    peak {capped['plain_peak_mib']:.1f} MiB, median step "
                f"{_median(peak['step_times']) * 1e3:.0f} ms")
            out(f"  cap:              {capped['cap_mib']} MiB (half the plain peak)")
            plain = capped["plain_capped"]
            if plain.get("failed"):
                out(f"  plain under cap:  process failed ({plain.get('returncode')})")
            else:
                out("  plain under cap:  " + (f"OOM ({plain['error']})" if plain["oom"]
                                              else "trained (no OOM!)"))
            run = capped["tfmem_capped"]
            if capped.get("oom_at"):
                out(f"  tfmem under cap:  partition_size={capped['oom_at']['partition_size']}: "
                    f"OOM ({capped['oom_at']['error']})")
            if run.get("failed") or run.get("oom"):
                out(f"  tfmem under cap:  FAILED {run.get('error') or run.get('stderr_tail')}")
            else:
                out(f"  tfmem under cap:  partition_size={capped['partition_size']}: "
                    f"{run['partitions']} partitions, median step {capped['step_ms']:.0f} ms, "
                    f"{capped['throughput']:.0f} examples/s, peak {capped['tfmem_peak_mib']:.1f}"
                    f" MiB")
                out(f"                    transfers (swap-out + uploads) "
                    f"{capped['transfer_share']:.1%} of step time, exposed (swap-out + wait) "
                    f"{capped['exposed_transfer_share']:.1%}, prefetch wait "
                    f"{capped['prefetch_wait_share']:.1%}")
                out(f"  tfmem last step:  {run['last_step']}")
    refusals = results.get("refusals")
    if refusals:
        out("\nrefused before running: "
            + ", ".join(f"{key.replace('_', ' ')} "
                        + ("not refused" if value is None else f"after {value:.2f} s")
                        for key, value in refusals.items()))
    if results.get("measure_cost"):
        out("")
        measure_cost.report(results["measure_cost"], out, prefix="(e) ")
    out("")
    for name, value in targets(results):
        out(_target_line(name, value))


def _kernel_path(results):
    """oneDNN on or off: as the result file's provenance records it, else this process's."""
    recorded = results.get("provenance", {}).get("kernel_path")
    return recorded or child_env.kernel_path(child_env.onednn_from_env(default=False))


def report_first_step(first, out=print):
    """The table of (c): where tfmem's first step goes, per session-graph size."""
    out(f"\n(c) first step vs session graph: MLP training step ({first['layers']} layers, "
        f"batch {first['batch']}) in a session graph filled with unrelated ops; seconds")
    out(f"{'config':>7} {'user':>6} {'graph':>6} {'ps':>4} {'parts':>5} {'calls':>5} {'copy':>5} "
        f"{'plan':>5} {'pred.':>5} "
        f"{'rewrite':>7} {'extend':>6} {'callab.':>7} {'setup':>6} {'ms/part':>7} {'run':>5} {'first':>6} {'plain':>6} "
        f"{'+ops':>5}")
    for r in first["rows"]:
        out(f"{r['config']:>7} {r.get('user_graph_ops', r['session_graph_ops']):>6} "
            f"{r['session_graph_ops']:>6} {r['partition_size']:>4} "
            f"{r['partitions']:>5} {r.get('callables', r['partitions']):>5} "
            f"{r.get('copy_s', 0.0):>5.2f} {r['plan_s']:>5.2f} {r['simulate_s']:>5.2f} "
            f"{r['rewrite_s']:>7.2f} {r['extend_s']:>6.2f} {r['callables_s']:>7.2f} "
            f"{r.get('setup_s', 0.0):>6.2f} {r.get('ms_per_partition', r['ms_per_callable']):>7.1f} "
            f"{r['first_run_s']:>5.2f} {r['first_step_s']:>6.2f} {r['plain_first_step_s']:>6.2f} "
            f"{r['added_ops']:>5}")
    out("  config tfmem: tfmem.Session (a session graph of what requests reach); default: "
        "a TFMemSession wrapping a default-config session on the user's graph")
    out("  user: ops in the user's graph; graph: ops in the session graph when the plan "
        "was compiled; ps: partition_size; "
        "calls: Session callables (one per stretch of partitions, see plan/stretches.py)")
    out("  copy: tfmem.Session copying the ops the request reaches into its session graph; "
        "plan / pred. / rewrite / extend / callab.: planning, memory prediction, copying the "
        "plan into the graph, TensorFlow taking in the grown graph, making the Session "
        "callables;")
    out("  setup: the first partial run's setup (one executor for every partition; 0 with "
        "callables); ms/part: (callab. + setup) / parts")
    out("  run: the first run of the partitions; first: tfs.run's first call in all; plain: "
        "plain Session.run's first call, same config; +ops: ops the plan's copies added")


def environment(mode):
    tf = _tf()
    try:
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    return dict(tensorflow=tf.__version__, python=platform.python_version(),
                cpus=os.cpu_count(), mode=mode, loadavg=load)


def run_all(args, log=None):
    """The whole benchmark as a dict (see `report`)."""
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    settings = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        settings["steps"] = settings["capped_steps"] = args.steps
    if args.warmup is not None:
        settings["warmup"] = settings["capped_warmup"] = args.warmup
    results = dict(env=environment("quick" if args.quick else "full"), settings=settings)
    if not args.skip_fits:
        results["fits"] = bench_fits(blocks=tuple(args.blocks), batch=args.batch,
                                     steps=settings["steps"], warmup=settings["warmup"],
                                     breakdown_steps=settings["breakdown_steps"],
                                     budget=args.budget, swap=args.swap,
                                     tfmem_config=args.tfmem_config,
                                     partial_runs=args.partial_runs,
                                     partition_sizes=tuple(
                                         p if p == "auto" else int(p)
                                         for p in args.partition_sizes),
                                     log=log)
    if not args.skip_plan:
        results["plan"] = bench_plan(args.plan_ops, log=log)
    if not args.skip_first_step:
        results["first_step"] = bench_first_step(
            graph_ops=tuple(args.first_step_graphs),
            default_sizes=(50,) if args.quick else None, partial_runs=args.partial_runs,
            log=log)
    if not args.skip_capped:
        results["capped"] = bench_capped(
            layers=args.capped_layers, width=256, batch=args.capped_batch,
            steps=settings["capped_steps"], warmup=settings["capped_warmup"],
            breakdown_steps=settings["breakdown_steps"],
            partition_size=args.capped_partition_size, log=log)
    results["refusals"] = bench_refusals()
    if args.measure_cost:
        results["measure_cost"] = measure_cost.run(steps=settings["steps"],
                                                   warmup=max(settings["warmup"], 6))
    if args.profile:
        results["profile"] = profile_fits(blocks=tuple(args.blocks), batch=args.batch)
    return results


def build_parser():
    parser = argparse.ArgumentParser(prog="python tools/bench.py", description=__doc__.split(
        "\n\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps (about 4 minutes on 2 cores)")
    parser.add_argument("--steps", type=int, help="timed steps per side and configuration")
    parser.add_argument("--warmup", type=int, help="warm-up steps (after tfmem's first step)")
    parser.add_argument("--blocks", type=int, nargs=3, default=[9, 9, 9],
                        help="ResNet blocks per stage (default 9 9 9: ResNet-56)")
    parser.add_argument("--batch", type=int, default=32, help="ResNet batch (default 32)")
    parser.add_argument("--partition-sizes", nargs="+", default=["50", "200", "auto"],
                        help="tfmem configurations of (a) (default: 50 200 auto)")
    parser.add_argument("--swap", choices=("auto", "all", "none"), default="auto",
                        help="tfmem's swap policy in (a) (default auto)")
    parser.add_argument("--budget", default="8GiB",
                        help="device_memory_budget of the 'auto' configuration (default 8GiB)")
    parser.add_argument("--plan-ops", type=int, default=100_000,
                        help="ops of the planning graph (default 100000)")
    parser.add_argument("--capped-layers", type=int, default=24)
    parser.add_argument("--capped-batch", type=int, default=2048)
    parser.add_argument("--capped-partition-size", default="auto",
                        help="tfmem's partition_size under the cap (default auto)")
    parser.add_argument("--skip-fits", action="store_true")
    parser.add_argument("--skip-plan", action="store_true")
    parser.add_argument("--skip-capped", action="store_true")
    parser.add_argument("--skip-first-step", action="store_true")
    parser.add_argument("--first-step-graphs", type=int, nargs="+", default=[2000, 10_000, 50_000],
                        help="session graph sizes (ops) of (c) (default 2000 10000 50000)")
    parser.add_argument("--tfmem-config", choices=("tfmem", "default"), default="tfmem",
                        help="config of tfmem's session in (a): tfmem.session_config() "
                             "(default) or TensorFlow's default; plain always uses the default")
    parser.add_argument("--measure-cost", action="store_true",
                        help="also (e): tfmem under a budget with measure='every', 'sample' "
                             "and 'off' against plain TensorFlow (tools/measure_cost.py)")
    parser.add_argument("--per-partition-rewrite", action="store_true",
                        help="copy plans with one import per partition (the rewrite before "
                             "plan_import), to compare")
    parser.add_argument("--partial-runs", action="store_true",
                        help="TFMemSession(partial_runs=True) in (a) and (c): one partial run "
                             "per step instead of one callable per stretch of partitions")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile tfmem steps at partition_size 50 and 200")
    parser.add_argument("--onednn", choices=("0", "1"),
                        help="TF_ENABLE_ONEDNN_OPTS for this process and its children "
                             "(default: the environment's value, else 0; never the machine's "
                             "default)")
    parser.add_argument("--json", metavar="OUT",
                        help="write every figure as JSON, with its provenance (commit, "
                             "TensorFlow, kernel path, cores, date)")
    # internal: one capped run in this process
    parser.add_argument("--child", choices=("peak", "plain", "tfmem"), help=argparse.SUPPRESS)
    parser.add_argument("--cap", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-settings", default="{}", help=argparse.SUPPRESS)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.child:
        out = child(args.child, args.cap, **json.loads(args.child_settings))
        print(json.dumps(out))
        return 0
    # before TensorFlow starts here: the kernel path is chosen, never the machine's default
    onednn = args.onednn or ("1" if child_env.onednn_from_env(default=False) else "0")
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = onednn
    if args.per_partition_rewrite:
        from tfmem.run import plan_import  # pylint: disable=import-outside-toplevel
        plan_import.ENABLED = False
    started_from = provenance.source()
    started = time.perf_counter()
    results = run_all(args)
    results["total_s"] = time.perf_counter() - started
    report(results)
    print(f"(bench took {results['total_s']:.0f} s)")
    if args.json:
        results.update(kind="bench", argv=list(sys.argv[1:] if argv is None else argv),
                       provenance=provenance.provenance(
                           child_env.kernel_path(onednn == "1"), started_from))
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
