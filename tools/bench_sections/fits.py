"""(a) A model that fits: plain TensorFlow and tfmem on one graph in this process,
steps alternating, per partition size (and budget mode far above the step's peak)."""

import os
import shutil
import tempfile
import time

import tfmem

from tools.bench_sections.shared import (MIB, fmt, median, session, tensorflow, timer_cost,
                                         traced_steps)


def _request_ops(tfs, fetches, feed):
    plan = tfs.plan(fetches, feed)
    return plan.num_ops


def run(blocks=(9, 9, 9), batch=32, partition_sizes=(50, 200, "auto"), steps=10,
               warmup=2, budget="8GiB", breakdown_steps=2, width=16, image=32, swap="auto",
               tfmem_config="tfmem", partial_runs=False, one_import=True, log=None):
    """Plain vs tfmem on one graph in this process; a dict with one entry per partition size.

    The plain session has TensorFlow's default config; tfmem's has `tfmem_config`.
    """
    log = log or (lambda text: None)
    tf = tensorflow()
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    started = time.perf_counter()
    model = models.resnet(blocks=blocks, width=width, image=image)
    build_s = time.perf_counter() - started
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    plain = session(tf, model.graph)
    wrapped = session(tf, model.graph, tfmem_config)
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
                                 options=tfmem.Options(partial_runs=partial_runs,
                                                       one_import=one_import), **kwargs)
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
        traced = traced_steps(tfs, lambda: tfs.run(fetches, feed), breakdown_steps,
                               os.path.join(trace_dir, f"fits_{size}.json"))
        swap_outs = [d.get("swap-out", (0, 0.0))[1] for d, _ in traced]
        swap_out_s = median(swap_outs)
        loop_excl = [s.wall_time - s.call_time - s.prefetch_wait_time - o
                     for (_, s), o in zip(traced, swap_outs)]
        plain_med, tfmem_med = median(plain_times), median(tfmem_times)
        overhead = [(r["wall"] - r["call_s"]) / parts for r in rows]
        loop_overhead = [(r["executor"] - r["call_s"]) / parts for r in rows]
        outside = [r["wall"] - r["executor"] for r in rows]
        # untraced time outside the executor (request, results) + the traced loop's own time
        excl = ((median(outside) + median(loop_excl)) / parts) if loop_excl else None
        config = dict(
            partition_size=size, partitions=parts, first_step_s=first_s,
            first_step_ratio=first_s / plain_first_s,
            compile=dict(plan_s=compiled.plan_time, simulate_s=compiled.simulate_time,
                         rewrite_s=compiled.rewrite_time, extend_s=compiled.extend_time,
                         callables_s=compiled.callables_time, callables=compiled.callables,
                         setup_s=first_step.setup_time, partial_run=first_step.partial_run,
                         build_s=first_step.build_time,
                         graph_ops_before=compiled.graph_ops_before,
                         graph_ops_after=compiled.graph_ops_after),
            request_ops=_request_ops(tfs, fetches, feed),
            plain_ms=plain_med * 1e3, tfmem_ms=tfmem_med * 1e3, ratio=tfmem_med / plain_med,
            paired_ratio=median([t / p for t, p in zip(tfmem_times, plain_times)]),
            plain_cpu_ms=median(plain_cpu) * 1e3, tfmem_cpu_ms=median(tfmem_cpu) * 1e3,
            cpu_ratio=median(tfmem_cpu) / median(plain_cpu),
            plain_times_ms=[t * 1e3 for t in plain_times],
            tfmem_times_ms=[t * 1e3 for t in tfmem_times],
            calls_ms=median([r["call_s"] for r in rows]) * 1e3,
            uploads=rows[-1]["uploads"] if rows else 0,
            upload_ms=median([r["upload_s"] for r in rows]) * 1e3,
            prefetch_wait_ms=median([r["wait"] for r in rows]) * 1e3,
            swap_out_ms=None if swap_out_s is None else swap_out_s * 1e3,
            outside_executor_ms=median(outside) * 1e3,
            overhead_ms_per_partition=median(overhead) * 1e3,
            loop_overhead_ms_per_partition=median(loop_overhead) * 1e3,
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


def report(fits, out=print):
    """The table of (a), with the first step of each configuration broken down."""
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
            f"{fmt(c['overhead_excl_transfers_ms_per_partition'], 9, 3)} "
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
            f"{k.get('callables', c['partitions'])} calls {k['callables_s']:.1f} s, "
            + (f"partial-run setup {k['setup_s']:.1f} s, " if k.get("partial_run") else
               f"first calls by name {k.get('build_s', 0.0):.1f} s (building and running), ")
            + f"graph {k['graph_ops_before']} -> "
            f"{k['graph_ops_after']} ops")


def targets(fits):
    """{name: value} of (a): step-time ratios, overhead per partition, first steps."""
    values = {}
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
    return values
