"""The experiments' command line: options, their defaults (normal and --quick), and the
options that reproduce a run's trial settings in a child process."""

import argparse
from pathlib import Path

from experiments.harness import steady
from experiments.harness.experiment import (ALLOCATORS, GRAPPLER_MEMORY_OPTIMIZATION,
                                            RESULTS_DIR, SESSION_CONFIGS)

BASE_DEFAULTS = dict(device_memory=None, batch_size=16, steps=None,
                     steady_steps=steady.STEADY_STEPS, max_steps=steady.MAX_STEPS,
                     partition_size="auto",
                     budget=None, swap="auto", swap_distance=2, prefetch=1, swap_min_bytes=None,
                     start=None, max_size=None, tolerance=0.0, trial_timeout=600.0,
                     search_time=None, max_trials=40, inter_op_threads=0, intra_op_threads=0,
                     cap_base=None,
                     cap_factor=1.0, onednn=0, partial_runs=False, measure=None)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def _partition_size(text):
    return "auto" if text == "auto" else positive_int(text)


def build_parser(experiment):
    size = experiment.size.replace("_", "-")
    parser = argparse.ArgumentParser(
        prog=f"python experiments/{Path(experiment.script).name}",
        description=f"{experiment.title}. With --system and --{size}: one trial in this "
                    "process, one JSON line on stdout. With --find-max: the largest "
                    f"--{size} that trains under the cap, per system, one process per trial. "
                    "--quick: the find-max run with small defaults, its table and a RESULT line.")
    run = parser.add_argument_group("what to run")
    run.add_argument("--system", action="append", choices=experiment.systems,
                     help="tf (plain TensorFlow), grappler (TensorFlow with Grappler's memory "
                          f"optimizer at {GRAPPLER_MEMORY_OPTIMIZATION}) or tfmem; repeat for "
                          "several (--find-max: default all three)")
    run.add_argument(f"--{size}", type=positive_int, dest="size", metavar="N",
                     help=experiment.size_help)
    run.add_argument("--find-max", action="store_true",
                     help="search the largest size that trains under the cap, per system")
    run.add_argument("--quick", action="store_true",
                     help="--find-max with small defaults (under 10 minutes on 2 cores), the "
                          "table and a RESULT line")
    trial = parser.add_argument_group("trial")
    trial.add_argument("--device-memory", type=positive_int, metavar="MiB",
                       help="emulated device-memory cap (TensorFlow's CPU allocator capped, "
                            "tfmem.emulate_accelerator); a search without it derives the cap "
                            "from plain TensorFlow's peak at --cap-base")
    trial.add_argument("--onednn", type=int, choices=(0, 1),
                       help="tfmem trials' kernel path (TF_ENABLE_ONEDNN_OPTS, default 0); plain "
                            "TensorFlow trials always run with 0: oneDNN kernels have crashed at "
                            "a full capped allocator instead of raising ResourceExhaustedError")
    trial.add_argument("--session-config", choices=SESSION_CONFIGS, default="default",
                       help="every system's session config: TensorFlow's defaults, or "
                       "tfmem.session_config() (Grappler's meta optimizer off, as tfmem.Session)")
    trial.add_argument("--allocator", choices=ALLOCATORS, default="grown",
                       help="every system's emulated device: TensorFlow's CPU allocator as it "
                            "grows (regions of 2, 4, 8 ... MiB, the last one what the cap "
                            "leaves), or one-region: the cap reserved as one region first "
                            "(tfmem.reserve_emulated_memory), as a GPU's allocator holds it")
    trial.add_argument("--batch-size", type=positive_int)
    trial.add_argument("--inter-op-threads", type=non_negative_int, metavar="N",
                       help="the sessions' inter_op_parallelism_threads (default 0: TensorFlow's "
                            "choice; 1 runs one op at a time: lower, steadier peaks, slower steps)")
    trial.add_argument("--intra-op-threads", type=non_negative_int, metavar="N",
                       help="the sessions' intra_op_parallelism_threads (default 0: one per core; "
                            "pin it for figures that must not depend on the machine)")
    trial.add_argument("--steps", type=positive_int,
                       help="a fixed number of training steps per trial (default: run until "
                            "--steady-steps steps follow the last re-plan, at most --max-steps)")
    trial.add_argument("--steady-steps", type=positive_int, metavar="N",
                       help="steps after the first step and the last re-plan whose median is "
                            f"the steady-state time (default {steady.STEADY_STEPS}; fewer: "
                            "not measured)")
    trial.add_argument("--max-steps", type=positive_int, metavar="N",
                       help="without --steps, a trial stops here even when re-plans keep "
                            f"coming (default {steady.MAX_STEPS})")
    tfm = parser.add_argument_group("tfmem")
    tfm.add_argument("--partition-size", type=_partition_size, metavar="N|auto",
                     help="ops per partition, or auto: budget mode (default auto)")
    tfm.add_argument("--budget", type=positive_int, metavar="MiB",
                     help="budget mode's device-memory budget (default: the cap)")
    tfm.add_argument("--swap", choices=("auto", "all", "none"))
    tfm.add_argument("--swap-distance", type=non_negative_int)
    tfm.add_argument("--prefetch", type=non_negative_int)
    tfm.add_argument("--swap-min-bytes", type=non_negative_int, metavar="BYTES",
                     help="tensors smaller than this stay on the device (default: tfmem's)")
    tfm.add_argument("--partial-runs", action="store_true", default=None,
                     help="TFMemSession(partial_runs=True): each step one DirectSession partial "
                          "run (one executor per request, not one callable per stretch of "
                          "partitions). A trial owns its session and ends at its "
                          "first failure, so the session a failed partial run cancels costs "
                          "nothing here. Implies --measure off unless given, outside budget "
                          "mode (measured steps run as callables there)")
    tfm.add_argument("--measure", choices=("sample", "every", "off"),
                     help="TFMemSession(measure=...): which steps read the allocator's figures "
                          "(default sample; off with --partial-runs outside budget mode). "
                          "Budget mode learns only from measured steps")
    search = parser.add_argument_group("search (--find-max, --quick)")
    search.add_argument("--cap-base", type=positive_int, metavar="N",
                        help=f"without --device-memory: measure plain TensorFlow's peak at --{size} "
                             "N on this machine (same allocator, no cap) and cap at it times "
                             "--cap-factor, so the cap means the same on every kernel path")
    search.add_argument("--cap-factor", type=float, metavar="F",
                        help="the derived cap is the plain peak at --cap-base times F, rounded up "
                             "to a MiB (default 1.0)")
    search.add_argument("--start", type=positive_int, metavar="N",
                        help=f"the --{size} the first system's search starts at (later systems "
                             "start at the largest size found so far)")
    search.add_argument("--max-size", type=positive_int, metavar="N",
                        help=f"never try a --{size} above this")
    search.add_argument("--tolerance", type=float, metavar="FRACTION",
                        help="stop the binary search when the bracket is within this fraction "
                             "of the largest size that trained (default 0: exact)")
    search.add_argument("--trial-timeout", type=float, metavar="SECONDS",
                        help="a trial running longer counts as failed (time)")
    search.add_argument("--search-time", type=float, metavar="SECONDS",
                        help="per system: start no trial after this much search time")
    search.add_argument("--max-trials", type=positive_int, help="per system")
    search.add_argument("--out-dir", type=Path, default=RESULTS_DIR,
                        help=f"where tables, CSV, JSON and the plot go (default {RESULTS_DIR})")
    search.add_argument("--tag", help="file name part of the outputs (default: quick, or "
                                      "cap<MiB>-b<batch>)")
    if experiment.add_arguments:
        experiment.add_arguments(parser.add_argument_group(f"model ({experiment.name})"))
    return parser


def parse_args(experiment, argv=None):
    """Parsed options with unset values filled from --quick's or the normal defaults."""
    parser = build_parser(experiment)
    args = parser.parse_args(argv)
    defaults = dict(BASE_DEFAULTS, **experiment.defaults)
    if args.quick:
        defaults.update(experiment.quick)
        args.find_max = True
    if args.device_memory is not None:
        # A cap given is the cap: the share of it the state fills (the Keras experiments'
        # --state-share, a default of their --quick) derives none, nor names the outputs.
        if getattr(args, "state_share", None) is not None:
            parser.error("--state-share derives the cap from the model's state; "
                         "--device-memory gives it: use one of them")
        defaults.pop("state_share", None)
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.size is not None:
        try:
            experiment.index_of(args.size)
        except ValueError as err:
            parser.error(str(err))
    if args.find_max and args.size is not None:
        parser.error(f"--{experiment.size.replace('_', '-')} picks one trial; with --find-max "
                     "use --start and --max-size")
    if not args.find_max:
        if not args.system or len(args.system) != 1 or args.size is None:
            parser.error(f"one trial needs one --system and --{experiment.size.replace('_', '-')}"
                         " (or use --find-max / --quick)")
    if args.tolerance < 0:
        parser.error("--tolerance must be >= 0")
    if args.steps is None and args.max_steps <= args.steady_steps:
        parser.error(f"--max-steps ({args.max_steps}) must exceed --steady-steps "
                     f"({args.steady_steps}): the first step is never a steady one")
    if args.cap_factor <= 0:
        parser.error("--cap-factor must be > 0")
    if args.find_max and args.device_memory is None and args.cap_base is None:
        parser.error("a search needs a cap: --device-memory MiB, or --cap-base N to derive it "
                     "from plain TensorFlow's peak at that size")
    if args.measure is None:
        # Outside budget mode a measured step runs the callables (a partial run returns no
        # step statistics), and a trial's few steps would all be measured ones under
        # "sample"; budget mode measures partial runs by the process figures and learns.
        budget_mode = args.partition_size == "auto" or args.budget is not None
        args.measure = "off" if args.partial_runs and not budget_mode else "sample"
    if args.cap_base is not None:
        try:
            experiment.index_of(args.cap_base)
        except ValueError as err:
            parser.error(f"--cap-base: {err}")
    return args


def tfmem_settings(args, **overrides):
    """TFMemSession's keyword arguments for the trial settings in `args` (not the budget)."""
    settings = dict(partition_size=args.partition_size, swap=args.swap,
                    swap_distance=args.swap_distance, prefetch=args.prefetch,
                    partial_runs=bool(args.partial_runs), measure=args.measure)
    if args.swap_min_bytes is not None:
        settings["swap_min_bytes"] = args.swap_min_bytes
    return dict(settings, **overrides)


def trial_options(experiment, args):
    """The command-line options that reproduce this run's trial settings in a child."""
    options = ["--batch-size", str(args.batch_size), "--steady-steps", str(args.steady_steps),
               "--max-steps", str(args.max_steps),
               "--partition-size", str(args.partition_size), "--swap", args.swap,
               "--swap-distance", str(args.swap_distance), "--prefetch", str(args.prefetch),
               "--inter-op-threads", str(args.inter_op_threads),
               "--intra-op-threads", str(args.intra_op_threads), "--measure", args.measure,
               "--session-config", args.session_config, "--allocator", args.allocator]
    if args.partial_runs:
        options.append("--partial-runs")
    if args.steps is not None:
        options += ["--steps", str(args.steps)]
    if args.device_memory is not None:
        options += ["--device-memory", str(args.device_memory)]
    if args.budget is not None:
        options += ["--budget", str(args.budget)]
    if args.swap_min_bytes is not None:
        options += ["--swap-min-bytes", str(args.swap_min_bytes)]
    for name in experiment.model_args:
        value = getattr(args, name)
        if value is not None:
            options += [f"--{name.replace('_', '-')}", str(value)]
    return options
