"""Soak: many training steps through TFMemSession under an emulated cap, watching for leaks.

    python tools/soak.py                   # 2000 steps, cap = half of plain TensorFlow's peak
    python tools/soak.py --steps 200 --json out.json

A week-long run must not grow.  The tool trains `tfmem.cli.models.mlp` through a
TFMemSession in a fresh process whose TensorFlow CPU allocator is capped (the
emulated accelerator, see tfmem.run.placement.accelerator), by default at half the peak a
plain Session needs for the same step (measured first, in another fresh
process), so tfmem has to partition and swap.  After the warm-up steps it
samples, every `--every` steps:

* host RSS (psutil), which would show leaked host buffers, handles' Python
  objects, plans or callables;
* TensorFlow's own device figure (`tf.config.experimental.get_memory_info`:
  bytes the capped allocator holds between steps), which would show leaked
  session handles or uploads;
* the host buffer pool's capacity.

It prints the growth per 1000 steps (least-squares slope of the samples) and
a verdict: device memory must not grow (beyond the allocator placing the
same variables in larger chunks), host RSS by no more than
`--rss-tolerance` MiB per 1000 steps over the later half of the samples (the
allocator of the Python process settles a MiB or two after the warm-up,
once; RSS is read after returning freed heap pages, malloc_trim), and tfmem's largest step peak must stay below
plain TensorFlow's (measured first, in its own process): under the cap a
step's peak is within the cap by construction, below plain's it is not.
The exit status is 0 for "no growth".

Both workers run under TensorFlow's BFC allocator (the plain one with a limit
far above the step, so it reports its peak on every kernel path) and with
TF_ENABLE_ONEDNN_OPTS set explicitly (`--onednn`, default 0).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MIB = 1 << 20
RESULT = "SOAK-RESULT "


def _auto_or_positive(text):
    """argparse type: 'auto' or an integer >= 1."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}")
    return int(text)


def _positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=_positive, default=2000)
    parser.add_argument("--warmup", type=_positive, default=100,
                        help="steps before sampling starts")
    parser.add_argument("--every", type=_positive, default=50, help="steps between samples")
    parser.add_argument("--cap", type=_auto_or_positive, default="auto",
                        help="emulated device memory in MiB, or 'auto': half plain TF's peak")
    parser.add_argument("--layers", type=_positive, default=8)
    parser.add_argument("--width", type=_positive, default=256)
    parser.add_argument("--batch", type=_positive, default=1024)
    parser.add_argument("--partition-size", type=_auto_or_positive, default="auto",
                        help="an int, or 'auto' (budget mode under the cap)")
    parser.add_argument("--swap", choices=["auto", "all", "none"], default="auto")
    parser.add_argument("--prefetch", type=int, choices=range(0, 100), default=1,
                        metavar="N")
    parser.add_argument("--onednn", type=int, choices=(0, 1), default=0,
                        help="kernel path of both workers (TF_ENABLE_ONEDNN_OPTS, default 0)")
    parser.add_argument("--rss-tolerance", type=float, default=2.0,
                        help="MiB of host RSS growth per 1000 steps still called no growth")
    parser.add_argument("--json", help="write every sample and figure to this file")
    parser.add_argument("--worker", choices=["plain-peak", "soak"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 2 * args.every:
        parser.error("--steps must leave at least two samples after --warmup")
    return args


def _model(args):
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.mlp(layers=args.layers, width=args.width, features=args.width)
    feeds = [model.feed(args.batch, seed) for seed in range(4)]  # made once: no data churn
    return model, feeds


def _session(tf, graph):
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=2)
    return tf.compat.v1.Session(graph=graph, config=config)


def _plain_peak(args):
    """Worker: plain TensorFlow's device peak for one step (allocator capped far above it)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    model, feeds = _model(args)
    sess = _session(tf, model.graph)
    sess.run(model.init)
    tf.config.experimental.reset_memory_stats("CPU:0")
    sess.run([model.train, model.loss], feed_dict=feeds[0])
    return {"plain_peak": tf.config.experimental.get_memory_info("CPU:0")["peak"]}


def _malloc_trim():
    """A callable returning glibc's free heap pages to the system (no-op elsewhere).

    Without it, host RSS moves by a MiB or so as malloc arenas grow and shrink,
    which a short run cannot tell from a leak; a leak stays live and is not trimmed.
    """
    import ctypes  # pylint: disable=import-outside-toplevel
    import ctypes.util  # pylint: disable=import-outside-toplevel
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return lambda: libc.malloc_trim(0)
    except (OSError, AttributeError):
        return lambda: None


def _soak(args):
    """Worker: train under the cap, sampling host RSS and TensorFlow's device bytes."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import psutil  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel
    model, feeds = _model(args)
    tfs = tfmem.TFMemSession(_session(tf, model.graph), partition_size=args.partition_size,
                             swap=args.swap,
                             prefetch=args.prefetch,  # the peak of every step is the figure
                             options=tfmem.Options(swap_min_bytes=0, measure="every"))
    tfs.run(model.init)
    plan = tfs.plan([model.train, model.loss], feed_dict=feeds[0])
    process = psutil.Process()
    trim = _malloc_trim()
    samples, losses, peak = [], [], 0  # only the first and last loss: lists that grow
    finite = True                      # every step would count as growth themselves
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        _, loss = tfs.run([model.train, model.loss], feed_dict=feeds[step % len(feeds)])
        finite = finite and bool(np.isfinite(loss))
        losses[1:] = [float(loss)]
        peak = max(peak, tfs.last_step.device_peak_bytes)
        if step >= args.warmup and (step - args.warmup) % args.every == 0:
            trim()  # hand freed heap back first: RSS then moves with what is live, not cached
            samples.append(dict(step=step, rss=process.memory_info().rss,
                                device=accelerator.device_memory("CPU:0")["current"],
                                host_buffers=tfs.host_buffers.capacity_bytes))
    wall = time.perf_counter() - started
    last = tfs.last_step
    with model.graph.as_default():
        state_bytes = sum(v.shape.num_elements() * v.dtype.size
                          for v in tf.compat.v1.global_variables())
    return dict(samples=samples, first_loss=losses[0], last_loss=losses[-1], finite=finite,
                state_bytes=state_bytes,
                partitions=len(plan.partitions), partition_size=plan.partition_size,
                swapped=sum(t.swapped for t in plan.transfers),
                swapped_out_bytes=last.swapped_out_bytes, max_device_peak=peak,
                seconds=wall, cap_mib=accelerator.emulated_memory_mib())


def _slope_per_1000(samples, key):
    """Least-squares growth of `key` per 1000 steps."""
    steps = [s["step"] for s in samples]
    values = [s[key] for s in samples]
    mean_step, mean_value = sum(steps) / len(steps), sum(values) / len(values)
    var = sum((x - mean_step) ** 2 for x in steps)
    cov = sum((x - mean_step) * (y - mean_value) for x, y in zip(steps, values))
    return cov / var * 1000 if var else 0.0


HEAP_STEP = MIB  # one growth of the C heap (see verdict)
HEAP_PAGES = 64 << 10  # and the pages beside it that step touches


def verdict(result, rss_tolerance_mib):
    """(ok, lines): device bytes must not rise past allocator chunking, RSS within the
    tolerance."""
    samples = result["samples"]
    device = [s["device"] for s in samples]
    rss = [s["rss"] for s in samples]
    # RSS is judged on the later half of the samples: malloc arenas and TensorFlow's
    # caches settle in steps after the warm-up (a MiB or two, once); a leak keeps going.
    settled = samples[len(samples) // 2:]
    growth = dict(device=_slope_per_1000(samples, "device"), rss=_slope_per_1000(settled, "rss"),
                  rss_all=_slope_per_1000(samples, "rss"),
                  host_buffers=_slope_per_1000(samples, "host_buffers"))
    # The device figure counts allocator chunks, not bytes asked for: when a variable's
    # buffer is copied on write, BFC may hand it a whole free chunk up to twice its size,
    # so the same live set reads differently from step to step (up and down by a
    # variable's size).  A leak raises the floor and keeps raising it: the
    # lowest sample of the last third may exceed the first third's by the state's bytes
    # (every variable re-placed at twice its size), no more.
    third = max(len(device) // 3, 1)
    floor_rise = min(device[-third:]) - min(device[:third])
    device_flat = floor_rise <= result.get("state_bytes", 0)
    # A leak keeps going; the C allocator grows its heap in steps (1 MiB once at step 120
    # in one run, at step 220 in another), which over a short window reads as a slope.
    # One such step in the settled half is allowed on top of the tolerance, no more, with
    # the few pages its bookkeeping touches (a rise printed as "+1.00 MiB in all" can be
    # over 1 MiB by a few KiB).
    settled_rise = max(s["rss"] for s in settled) - settled[0]["rss"]
    rss_ok = growth["rss"] <= rss_tolerance_mib * MIB or settled_rise <= HEAP_STEP + HEAP_PAGES
    buffers_flat = len({s["host_buffers"] for s in samples}) == 1
    plain_peak = result.get("plain_peak")
    below_plain = plain_peak is None or result["max_device_peak"] < plain_peak
    ok = device_flat and rss_ok and buffers_flat and result["finite"] and below_plain
    lines = [
        f"steps {samples[-1]['step']}, sampled from step {samples[0]['step']} every "
        f"{samples[1]['step'] - samples[0]['step']} ({len(samples)} samples), "
        f"{result['seconds']:.0f} s ({result['seconds'] / samples[-1]['step'] * 1e3:.1f} ms/step)",
        f"cap {result['cap_mib']} MiB, plain TF peak "
        + (f"{result['plain_peak'] / MIB:.1f} MiB" if result.get("plain_peak") else "not measured")
        + f"; tfmem: {result['partitions']} partitions (partition_size "
        f"{result['partition_size']}), {result['swapped']} tensors swapped "
        f"({result['swapped_out_bytes'] / MIB:.1f} MiB out per step), device peak "
        f"{result['max_device_peak'] / MIB:.2f} MiB at most"
        + ("" if plain_peak is None else
           f" ({result['max_device_peak'] / plain_peak:.2f}x plain TF's peak: "
           + ("below it)" if below_plain else "NOT below it)")),
        f"loss {result['first_loss']:.5f} -> {result['last_loss']:.5f} (all finite: "
        f"{result['finite']})",
        f"TF device memory between steps: {min(device)} .. {max(device)} bytes, growth "
        f"{growth['device'] / 1024:+.1f} KiB per 1000 steps; lowest sample of the last "
        f"third {floor_rise:+d} bytes over the first third's (allowed: the state's "
        f"{result.get('state_bytes', 0)} bytes, allocator chunks)",
        f"host RSS: {min(rss) / MIB:.1f} .. {max(rss) / MIB:.1f} MiB, growth "
        f"{growth['rss'] / MIB:+.2f} MiB per 1000 steps from step {settled[0]['step']} on "
        f"(tolerance {rss_tolerance_mib} MiB, or one heap step of {HEAP_STEP / MIB:.0f} MiB; "
        f"{settled_rise / MIB:+.2f} MiB in all from there; "
        f"{growth['rss_all'] / MIB:+.2f} per 1000 over all samples)",
        f"host buffers: {samples[-1]['host_buffers'] / MIB:.1f} MiB, growth "
        f"{growth['host_buffers'] / MIB:+.2f} MiB per 1000 steps",
        "VERDICT " + ("no growth" if ok else "GROWTH or failure (see above)"),
    ]
    return ok, lines, growth


def _run_worker(args, argv, cap_mib=None):
    """Run this script as a worker in a fresh process; return its result dict.

    cap_mib None: the BFC allocator with a limit far above the step.
    """
    from tfmem.cli import child_env  # pylint: disable=import-outside-toplevel
    env = child_env.child_env(cap_mib=cap_mib, onednn=bool(args.onednn))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)] + argv, env=env,
                          capture_output=True, text=True, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {argv[-1]} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT):])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        result = (_plain_peak if args.worker == "plain-peak" else _soak)(args)
        print(RESULT + json.dumps(result))
        return 0
    # Plain TensorFlow's peak for one step, in its own process: the cap's base
    # (--cap auto) and the figure tfmem's peaks are checked against.
    plain_peak = _run_worker(args, argv + ["--worker", "plain-peak"])["plain_peak"]
    cap = max(plain_peak // 2 // MIB, 1) if args.cap == "auto" else args.cap
    result = _run_worker(args, argv + ["--worker", "soak"], cap_mib=cap)
    result["plain_peak"] = plain_peak
    ok, lines, growth = verdict(result, args.rss_tolerance)
    print("\n".join(lines))
    if args.json:
        from tfmem.cli import child_env, provenance  # pylint: disable=import-outside-toplevel
        origin = provenance.provenance(child_env.kernel_path(bool(args.onednn)))
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(dict(result, growth_per_1000=growth, ok=ok, args=vars(args),
                           verdict=lines, provenance=origin), out, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
