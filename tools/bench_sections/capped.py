"""(b) A model that trains only with tfmem: three fresh processes (the cap is read when
TensorFlow starts) run `tools/bench.py --child`: plain's peak without a cap, plain
under half of it (must run out of memory), tfmem under the same cap."""

import json
import os
import shutil
import sys
import tempfile
import time

import tfmem
from tfmem.cli import child_env

from tools.bench_sections.shared import MIB, median, session, tensorflow, traced_steps

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench.py")


def child(kind, cap_mib, layers, width, batch, steps, warmup, breakdown_steps, partition_size):
    """One capped run in this (fresh) process: kind is peak, plain or tfmem. Returns a dict."""
    tfmem.emulate_accelerator(cap_mib)  # before TensorFlow is imported
    tf = tensorflow()
    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.mlp(layers=layers, width=width)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    sess = session(tf, model.graph)
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
        traced = traced_steps(runner, lambda: runner.run(fetches, feed), breakdown_steps,
                               os.path.join(trace_dir, "capped.json"))
        shutil.rmtree(trace_dir, ignore_errors=True)
        out["traced"] = [dict(wall=s.wall_time, wait=s.prefetch_wait_time,
                              tracks={k: list(v) for k, v in d.items()}) for d, s in traced]
    return out


def run_child(kind, cap_mib, settings, timeout=900):
    cmd = [sys.executable, BENCH, "--child", kind, "--cap", str(cap_mib),
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


def summarize(run, batch):
    """Throughput and transfer shares of a capped tfmem run (the child's dict)."""
    step_s = median(run["step_times"])
    shares, exposed = [], []
    for step in run.get("traced", []):
        tracks = step["tracks"]
        swap_out = tracks.get("swap-out", (0, 0.0))[1]
        upload = tracks.get("prefetch", (0, 0.0))[1]
        shares.append((swap_out + upload) / step["wall"])
        exposed.append((swap_out + step["wait"]) / step["wall"])
    waits = [w / t for w, t in zip(run.get("waits", []), run.get("walls", []))]
    return dict(step_ms=step_s * 1e3 if step_s else None,
                throughput=batch / step_s if step_s else None,
                transfer_share=median(shares), exposed_transfer_share=median(exposed),
                prefetch_wait_share=median(waits))


def run(layers=24, width=256, batch=2048, steps=4, warmup=1, breakdown_steps=2,
                 partition_size="auto", fallback=50, log=None):
    """Plain peak, plain under half of it, tfmem under half of it: three processes."""
    log = log or (lambda text: None)
    settings = dict(layers=layers, width=width, batch=batch, steps=steps, warmup=warmup,
                    breakdown_steps=breakdown_steps, partition_size=partition_size)
    result = dict(model=f"MLP {layers}x{width}", **settings)
    peak = run_child("peak", 16384, dict(settings, steps=2, warmup=1))
    result["plain_uncapped"] = peak
    if peak["failed"] or not peak["peak_bytes"]:
        log("(b) plain peak run failed:\n" + peak.get("stderr_tail", ""))
        return result
    cap = int(peak["peak_bytes"] / MIB / 2)
    result["plain_peak_mib"] = peak["peak_bytes"] / MIB
    result["cap_mib"] = cap
    log(f"(b) {result['model']}, batch {batch}: plain peak {result['plain_peak_mib']:.1f} MiB, "
        f"cap {cap} MiB")
    result["plain_capped"] = run_child("plain", cap, dict(settings, steps=1, warmup=0))
    run = run_child("tfmem", cap, settings)
    if not run["failed"] and run["oom"] and fallback and partition_size != fallback:
        # Budget mode plans to the cap less 10 %; where the simulator underestimates the
        # measured peak (docs/results.md: the MLP) a step can still run out: say so, then measure
        # a fixed partition size with room to spare.
        result["oom_at"] = dict(partition_size=partition_size, error=run["error"])
        log(f"    tfmem partition_size={partition_size} ran out of memory under the cap; "
            f"measuring partition_size={fallback}")
        result["partition_size"] = fallback
        run = run_child("tfmem", cap, dict(settings, partition_size=fallback))
    result["tfmem_capped"] = run
    if not run["failed"] and not run["oom"]:
        result.update(summarize(run, batch))
        result["tfmem_peak_mib"] = run["peak_bytes"] / MIB
    return result


def report(capped, out=print, kernel_path=""):
    """The lines of (b); `kernel_path`: oneDNN on or off, as the run recorded it."""
    out(f"\n(b) capped: {capped['model']}, batch {capped['batch']}, one process per run, "
        f"kernel path: {kernel_path}")
    peak = capped.get("plain_uncapped", {})
    if "cap_mib" not in capped:
        out(f"  plain peak run failed: {peak.get('stderr_tail', '')}")
    else:
        out(f"  plain, no cap:    peak {capped['plain_peak_mib']:.1f} MiB, median step "
            f"{median(peak['step_times']) * 1e3:.0f} ms")
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


def targets(capped):
    """{name: value} of (b): whether plain ran out, tfmem's throughput and transfer shares."""
    values = {}
    plain = capped.get("plain_capped") or {}
    values["capped_plain"] = "OOM" if plain.get("oom") else (
        "failed" if plain.get("failed", True) else "fits")
    if capped.get("throughput"):
        values["capped_tfmem_examples_per_s"] = capped["throughput"]
        values["transfer_share"] = capped["transfer_share"]
        values["prefetch_wait_share"] = capped["prefetch_wait_share"]
    else:
        values["capped_tfmem_examples_per_s"] = "failed"
    return values
