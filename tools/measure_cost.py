"""What measuring steps costs: tfmem under a budget with measure="every", "sample" and
"off", against plain TensorFlow, in one process and one run.

    python tools/measure_cost.py [--layers 24] [--batch 2048] [--steps 20] [--json OUT]
                                 [--onednn]

One fresh process (oneDNN off, TensorFlow's BFC allocator capped far above
the step so it keeps figures): a plain session measures the step's peak; then
three TFMemSessions on the same session run under a budget of half that peak
(so they partition and swap as under a real cap), each with one measure mode.
After warm-up steps (more than sampling's warm-up, so "sample" is in its
steady phase), the timed steps go round-robin (plain, every, sample, off,
order rotated each round) so load on the shared machine hits all alike; the
medians of wall time and of process CPU time (which others' load moves
less) and their ratios to plain are printed and returned.  `--onednn`: oneDNN
on and no cap instead (its CPU allocator keeps the figures), where tfmem
measures steps since it reads figures on every allocator that keeps them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("every", "sample", "off")
MIB = 1 << 20


def child(layers, width, batch, steps, warmup, onednn=False):
    """The benchmark in this process (TensorFlow not yet imported); returns a dict."""
    import tfmem  # pylint: disable=import-outside-toplevel
    if not onednn:  # with oneDNN on, its allocator keeps the figures without a cap
        tfmem.emulate_accelerator(16384)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.run import accelerator  # pylint: disable=import-outside-toplevel
    from tfmem.cli import models  # pylint: disable=import-outside-toplevel
    model = models.mlp(layers=layers, width=width)
    feed = model.feed(batch)
    fetches = [model.train, model.loss]
    config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                      inter_op_parallelism_threads=1)
    sess = tf.compat.v1.Session(graph=model.graph, config=config)
    tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
    accelerator.reset_peak("CPU:0")  # this tool's own process: nobody else's figure
    sess.run(fetches, feed)
    plain_peak = accelerator.device_memory("CPU:0")["peak"]
    budget = plain_peak // 2
    runners = {"plain": lambda: sess.run(fetches, feed)}
    sessions = {}
    for mode in MODES:
        tfs = sessions[mode] = tfmem.TFMemSession(sess, device_memory_budget=budget,
                                                  measure=mode)
        runners[mode] = (lambda t: lambda: t.run(fetches, feed))(tfs)
    for _ in range(warmup):
        for run in runners.values():
            run()
    times = {name: [] for name in runners}
    cpu = {name: [] for name in runners}  # process CPU seconds: less moved by others' load
    measured = {mode: 0 for mode in MODES}
    names = list(runners)
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            started, cpu_started = time.perf_counter(), time.process_time()
            runners[name]()
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - cpu_started)
            if name in sessions:
                measured[name] += sessions[name].last_step.measured
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu_medians = {name: statistics.median(t) for name, t in cpu.items()}
    return dict(model=f"MLP {layers}x{width}, batch {batch}, oneDNN {'on' if onednn else 'off'}",
                plain_peak_mib=plain_peak / MIB,
                budget_mib=budget / MIB,
                partitions={mode: tfs.last_step.partitions for mode, tfs in sessions.items()},
                steps=steps, warmup=warmup, median_ms={k: v * 1e3 for k, v in medians.items()},
                ratio={mode: medians[mode] / medians["plain"] for mode in MODES},
                cpu_median_ms={k: v * 1e3 for k, v in cpu_medians.items()},
                cpu_ratio={mode: cpu_medians[mode] / cpu_medians["plain"] for mode in MODES},
                measured_timed_steps=measured, loadavg=os.getloadavg()[0])


def run(layers=24, width=256, batch=2048, steps=20, warmup=15, timeout=1800, onednn=False):
    """The benchmark in a fresh process (the allocator's cap is read at TensorFlow's start)."""
    settings = dict(layers=layers, width=width, batch=batch, steps=steps, warmup=warmup,
                    onednn=onednn)
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1" if onednn else "0",
               TF_CPP_MIN_LOG_LEVEL="2")
    if onednn:  # no BFC allocator: oneDNN's own keeps the figures
        env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
        env.pop("TF_CPU_BFC_MEM_LIMIT_IN_MB", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                           json.dumps(settings)], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError("measure-cost process failed:\n" + done.stderr[-3000:])
    return json.loads(lines[-1])


def report(result, out=print, prefix=""):
    out(f"{prefix}measurement cost: {result['model']}, budget {result['budget_mib']:.0f} MiB "
        f"(half the plain peak {result['plain_peak_mib']:.0f} MiB), "
        f"median of {result['steps']} steps after "
        f"{result['warmup']} warm-up, load {result['loadavg']:.1f}")
    out(f"  plain TensorFlow        wall {result['median_ms']['plain']:8.1f} ms, CPU "
        f"{result['cpu_median_ms']['plain']:8.1f} ms")
    for mode in MODES:
        out(f"  tfmem measure={mode!r:<8} wall {result['median_ms'][mode]:8.1f} ms "
            f"({result['ratio'][mode]:4.2f}x plain), CPU {result['cpu_median_ms'][mode]:8.1f} "
            f"ms ({result['cpu_ratio'][mode]:4.2f}x plain)  "
            f"({result['partitions'][mode]} partitions; "
            f"{result['measured_timed_steps'][mode]} of the timed steps measured)")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=15, help="untimed steps per side first")
    parser.add_argument("--json", metavar="OUT", help="write the figures as JSON")
    parser.add_argument("--onednn", action="store_true",
                        help="oneDNN on, no emulated cap (its allocator keeps the figures)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(**json.loads(args.child))))
        return 0
    result = run(args.layers, args.width, args.batch, args.steps, args.warmup,
                 onednn=args.onednn)
    report(result)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
