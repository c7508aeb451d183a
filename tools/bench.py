"""Benchmark of tfmem's step time, per-partition overhead, planning time and
capped training.

    python tools/bench.py [--quick] [--steps N] [--warmup N] [--json OUT.json]
                          [--skip-fits] [--skip-plan] [--skip-capped] [--profile]

Sections, one module each under tools/bench_sections/ (shared.py: what they share):

(a) A model that fits (fits.py): ResNet-56 (`tfmem.cli.models.resnet(blocks=(9, 9, 9))`,
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

    Planning (planning.py): a chain graph of ~100,000 ops (a forward chain and a
    hand-written backward chain that reads every forward activation, so
    transfers span the graph the way a training step's do), imported as one
    GraphDef (building it op by op would take minutes).  `tfs.plan` is timed
    on its first call and again on a second call, which should only look the
    plan up in the cache.

(b) A model that trains only with tfmem (capped.py): `tfmem.cli.models.mlp(layers=24,
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

(c) The first step against the session graph's size (first_step.py); requests
    refused before they run (refusals.py); with --profile, cProfile of tfmem steps
    (profile.py).

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
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run as a script: import from the root

from tfmem.cli import child_env, provenance  # noqa: E402  (imports no TensorFlow)
from tools.bench_sections import (capped, first_step, fits, planning, profile,  # noqa: E402
                                  refusals)
from tools.bench_sections.shared import tensorflow  # noqa: E402

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


def targets(results):
    """[(name, value)] of the machine-readable figures, section by section."""
    values = {}
    for key, section in (("fits", fits), ("plan", planning), ("first_step", first_step),
                         ("capped", capped), ("refusals", refusals)):
        if results.get(key):
            values.update(section.targets(results[key]))
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


def report(results, out=print):
    """The compact report, then one TARGET line per figure."""
    env = results["env"]
    out(f"tfmem bench: TensorFlow {env['tensorflow']}, Python {env['python']}, "
        f"{env['cpus']} CPUs, {env['mode']}, load average at start {env['loadavg']}")
    if results.get("fits"):
        fits.report(results["fits"], out)
    if results.get("plan"):
        planning.report(results["plan"], out)
    if results.get("first_step"):
        first_step.report(results["first_step"], out)
    if results.get("capped"):
        capped.report(results["capped"], out, kernel_path(results))
    if results.get("refusals"):
        refusals.report(results["refusals"], out)
    out("")
    for name, value in targets(results):
        out(_target_line(name, value))


def kernel_path(results):
    """oneDNN on or off: as the result file's provenance records it, else this process's."""
    recorded = results.get("provenance", {}).get("kernel_path")
    return recorded or child_env.kernel_path(child_env.onednn_from_env(default=False))


def environment(mode):
    """TensorFlow, Python, cores, mode and load: the report's first line."""
    tf = tensorflow()
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
        results["fits"] = fits.run(blocks=tuple(args.blocks), batch=args.batch,
                                     steps=settings["steps"], warmup=settings["warmup"],
                                     breakdown_steps=settings["breakdown_steps"],
                                     budget=args.budget, swap=args.swap,
                                     tfmem_config=args.tfmem_config,
                                     partial_runs=args.partial_runs,
                                     one_import=not args.per_partition_rewrite,
                                     partition_sizes=tuple(
                                         p if p == "auto" else int(p)
                                         for p in args.partition_sizes),
                                     log=log)
    if not args.skip_plan:
        results["plan"] = planning.run(args.plan_ops, log=log)
    if not args.skip_first_step:
        results["first_step"] = first_step.run(
            graph_ops=tuple(args.first_step_graphs),
            default_sizes=(50,) if args.quick else None, partial_runs=args.partial_runs,
            log=log)
    if not args.skip_capped:
        results["capped"] = capped.run(
            layers=args.capped_layers, width=256, batch=args.capped_batch,
            steps=settings["capped_steps"], warmup=settings["capped_warmup"],
            breakdown_steps=settings["breakdown_steps"],
            partition_size=args.capped_partition_size, log=log)
    results["refusals"] = refusals.run()
    if args.profile:
        results["profile"] = profile.run(blocks=tuple(args.blocks), batch=args.batch)
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
    parser.add_argument("--per-partition-rewrite", action="store_true",
                        help="(a) copies plans with one import per partition "
                             "(tfmem.Options(one_import=False)), to compare")
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
        out = capped.child(args.child, args.cap, **json.loads(args.child_settings))
        print(json.dumps(out))
        return 0
    # before TensorFlow starts here: the kernel path is chosen, never the machine's default
    onednn = args.onednn or ("1" if child_env.onednn_from_env(default=False) else "0")
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = onednn
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
