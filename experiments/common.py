"""Shared machinery of the experiments: one trial per process, the max-size search, reports.

An experiment script (``resnet.py``; later ``moe.py``, ``deepspeech.py``)
describes its model with an :class:`Experiment` (how to build the graph from
TensorFlow ops, its size knob and its defaults) and calls :func:`main`.
Everything else lives here:

* **one trial** (the script run with ``--system`` and a size): sets the
  emulated device-memory cap *before* TensorFlow is imported, builds the
  model, trains it with plain TensorFlow (``tf``), TensorFlow
  with Grappler's memory optimizer at its strongest setting (``grappler``) or
  a ``tfmem.TFMemSession`` (``tfmem``) until the steady state is measured
  (``steady.py``: the first step, re-plans, then steps after them), and
  prints one JSON line;
* **the search** (``--find-max``): per system, the largest size that trains
  under the cap, by exponential then binary search on the size knob, each
  trial in its own process (the cap is read once, when TensorFlow starts),
  with a time limit per trial and a text progress bar on stderr;
* **reports**: the paper-shaped table as markdown and CSV, every trial as
  CSV and JSON, a PNG of size against steady-state throughput (skipped, with a note, when
  matplotlib is missing), and a ``RESULT`` line.

Nothing here imports TensorFlow at module level.
"""

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import steady
import tfmem
from tfmem.run import accelerator
from tfmem.cli import child_env
from tfmem.cli import provenance as tfmem_provenance

MIB = 1 << 20
SYSTEMS = ("tf", "grappler", "tfmem")
# How every system's emulated device holds memory (--allocator, allocator_note).
ALLOCATORS = ("grown", "one-region")
# Every system's session config (--session-config): TensorFlow's defaults, or
# tfmem.session_config() (Grappler off: tfmem then plans without units.py's rule 5).
SESSION_CONFIGS = ("default", "tfmem")
# Grappler's memory optimizer levels (RewriterConfig.MemOptType).  HEURISTICS is
# the strongest: it runs the recomputation heuristics (cheap ops such as batch
# norm and ReLU recomputed in the backward pass) and the scheduling and swapping
# passes, which plain TensorFlow (DEFAULT_MEM_OPT) runs without recomputation.
GRAPPLER_MEMORY_OPTIMIZATION = "HEURISTICS"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
SYSTEM_LABELS = {"tf": "TensorFlow",
                 "grappler": f"TensorFlow + Grappler memory optimizer ({GRAPPLER_MEMORY_OPTIMIZATION})",
                 "tfmem": "tfmem (TFMemSession)"}
# How a failed trial is described in the reports: what limited the system there.
LIMITS = {"oom": "device memory (ResourceExhaustedError)",
          "crash": "a crash at the cap (the process died, no ResourceExhaustedError)",
          "budget": "device memory (tfmem: nothing fits the budget)",
          "host-memory": "host memory (tfmem refused the plan)",
          "timeout": "time (trial time limit)",
          "error": "FAILURE of the run (not a size limit)",
          "unsupported": "the system refused the model (its error is the result)",
          "search-time": "time (search time limit)",
          "max-size": "the --max-size limit",
          "max-trials": "the --max-trials limit"}
# Trial outcomes that mean "this size does not fit" (or, for timeout, "not in the time
# given") and may end a search as its limit.  Anything else (an exception of another
# kind, a tfmem process that crashed, a child without a result) is a failure of the run:
# the search stops and says so, it never passes for a size limit.
SIZE_LIMITS = ("oom", "budget", "host-memory", "timeout")
PLAIN_SYSTEMS = ("tf", "grappler")  # run without oneDNN: its kernels crashed at a full cap


def is_tfmem(system):
    """True for a system that trains through tfmem ("tfmem", or "tfmem+..." combined with
    another technique); every other system is a baseline, run without oneDNN."""
    return system.split("+")[0] == "tfmem"


def is_size_limit(result):
    """True when a failed trial's outcome may end a search as the system's limit.

    A crash counts only for a plain TensorFlow system (recorded as a crash, since
    TensorFlow's kernels can die at a full capped allocator); a tfmem process that
    crashes is a failure of the run.
    """
    status = result.get("status")
    return status in SIZE_LIMITS or (status == "crash" and not is_tfmem(result.get("system", "")))


@dataclasses.dataclass
class Model:
    """A built training step: what a trial runs."""
    graph: object
    loss: object
    train_op: object
    init: object
    feed: dict  # a feed_dict of seeded synthetic data, fed at every step
    parameters: int  # trainable parameters
    examples: int  # examples per step (the batch size)


@dataclasses.dataclass
class Experiment:
    """What a model script tells the shared machinery.

    sizes: search index k (1, 2, ...) -> size knob value (strictly increasing).
    index_of: size knob value -> k; raises ValueError for a size the model cannot take.
    build: (tensorflow module, size, parsed args) -> Model, in a new graph.
    add_arguments: adds the model's own options (forwarded to trials: model_args).
    report: optional (args, summaries, stem, out) -> Extra, run after the search: the
        model's own measurements and tables (files under `stem`, a path without suffix).
    defaults / quick: option values without / with --quick (None in argparse means unset).
    """
    name: str
    title: str
    size: str  # the size option, e.g. "layers"
    size_help: str
    sizes: object
    index_of: object
    build: object
    script: str
    add_arguments: object = None
    model_args: tuple = ()
    defaults: dict = dataclasses.field(default_factory=dict)
    quick: dict = dataclasses.field(default_factory=dict)
    unit: str = "examples"
    # one unit of work: the size knob's unit times one example, e.g. "layer-image"
    work_unit: str = "size-example"
    report: object = None
    # Experiments of other systems (the Keras ones): their names and labels, the one the
    # RESULT line divides by, the trial that runs in a child process (experiment, args) ->
    # result dict, and the systems notes of the report (args) -> list of lines.
    systems: tuple = SYSTEMS
    labels: dict = dataclasses.field(default_factory=lambda: dict(SYSTEM_LABELS))
    baseline: str = "tf"
    trial: object = None
    system_notes: object = None
    # (experiment, args, out) -> cap info (derive_cap's dict, with a "note" saying how the
    # cap was chosen): the experiment's own rule for the cap, in place of derive_cap.
    derive_cap: object = None


@dataclasses.dataclass
class Extra:
    """What a model's own report adds to the run's outputs."""
    markdown: str  # appended to the markdown file and printed after the main table
    data: object = None  # stored in the JSON under "extra"
    paths: tuple = ()  # files it wrote


BASE_DEFAULTS = dict(device_memory=None, batch_size=16, steps=None,
                     steady_steps=steady.STEADY_STEPS, max_steps=steady.MAX_STEPS,
                     partition_size="auto",
                     budget=None, swap="auto", swap_distance=2, prefetch=1, swap_min_bytes=None,
                     start=None, max_size=None, tolerance=0.0, trial_timeout=600.0,
                     search_time=None, max_trials=40, inter_op_threads=0, intra_op_threads=0,
                     cap_base=None,
                     cap_factor=1.0, onednn=0, partial_runs=False, measure=None)


# --------------------------------------------------------------------------
# arguments


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
                            f"from plain TensorFlow's peak at --cap-base")
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


def script_model(model_name, argv, device_memory_mib):
    """(tf, experiment, args, model) for a script that studies one experiment's model in its
    own process: the experiments' kernel path unless the environment sets one, the allocator
    capped at `device_memory_mib` before TensorFlow starts, the experiment's options from
    `argv` (as a tfmem trial takes them)."""
    import importlib  # pylint: disable=import-outside-toplevel
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    tfmem.emulate_accelerator(device_memory_mib)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    experiment = importlib.import_module(model_name).EXPERIMENT
    args = parse_args(experiment, ["--system", "tfmem"] + list(argv))
    return tf, experiment, args, experiment.build(tf, args.size, args)


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


# --------------------------------------------------------------------------
# one trial, in this process


def session_config(tf, system, inter_op_threads=0, intra_op_threads=0, kind="default"):
    """The ConfigProto of a system's session: TensorFlow's defaults (kind "default") or
    tfmem.session_config()'s (kind "tfmem": Grappler's meta optimizer off, for every
    system alike), plus Grappler's memory optimizer for `grappler` (which does not run
    under "tfmem")."""
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads,
                                      intra_op_parallelism_threads=intra_op_threads)
    if kind == "tfmem":
        config = tfmem.session_config(config)
    if system == "grappler":
        from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=import-outside-toplevel
        config.graph_options.rewrite_options.memory_optimization = getattr(
            rewriter_config_pb2.RewriterConfig, GRAPPLER_MEMORY_OPTIMIZATION)
    return config


def _first_line(message):
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("OOM when allocating"):
            return line.split(" on /job")[0]
    return lines[0][:300] if lines else ""


PHASE = "PHASE"  # stderr marker of a trial's progress, read back when it times out or crashes


def _phase(name, started):
    print(f"{PHASE} {name} {time.perf_counter() - started:.1f}", file=sys.stderr, flush=True)


def run_trial(experiment, args):
    """Build and train one size with one system in this process; the result dict.

    The cap must already be set (main does it before importing TensorFlow).
    Progress goes to stderr as PHASE lines, so that a parent that has to kill
    the trial (time limit) or sees it crash can tell how far it got.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfmem.run import accelerator  # pylint: disable=import-outside-toplevel

    if args.allocator == "one-region":
        tfmem.reserve_emulated_memory()
    system = args.system[0]
    limit = accelerator.emulated_memory_mib()
    result = dict(experiment=experiment.name, system=system, size_name=experiment.size,
                  size=args.size, index=experiment.index_of(args.size),
                  batch_size=args.batch_size, steps=None,
                  device_memory_mib=None if limit == child_env.MEASURE_LIMIT_MIB else limit,
                  allocator_limit_mib=limit,
                  kernel_path=child_env.kernel_path(child_env.onednn_from_env()),
                  model={name: getattr(args, name) for name in experiment.model_args},
                  status=None, ok=False, error=None, parameters=None, state_bytes=None,
                  step_times=[], losses=[], throughput=None, peak_bytes=None, step_peaks=[],
                  resident_after_init_bytes=None, resident_after_steps_bytes=None,
                  build_seconds=None, first_step_seconds=None, seconds=None,
                  replans=None, replan_steps=None, recompiles=None, steady_step_count=None,
                  steady_seconds=None, steady_ms_per_unit=None, work_unit=experiment.work_unit,
                  grappler=GRAPPLER_MEMORY_OPTIMIZATION if system == "grappler" else None,
                  session_config=args.session_config, allocator=args.allocator,
                  tfmem=None)
    _phase("building", started)
    model = experiment.build(tf, args.size, args)
    result["parameters"] = model.parameters
    with model.graph.as_default():
        result["state_bytes"] = sum(
            v.shape.num_elements() * v.dtype.size for v in tf.compat.v1.global_variables())
    result["build_seconds"] = time.perf_counter() - started
    sess = tf.compat.v1.Session(graph=model.graph,
                                config=session_config(tf, system, args.inter_op_threads,
                                                       args.intra_op_threads,
                                                       args.session_config))
    runner = sess
    if system == "tfmem":
        settings = tfmem_settings(args)
        if args.budget is not None:
            settings["device_memory_budget"] = args.budget * MIB
        runner = tfmem.TFMemSession(sess, **settings)
        budget = args.budget if args.budget is not None else (
            result["device_memory_mib"] if args.partition_size == "auto" else None)
        result["tfmem"] = dict(settings, budget_mib=budget, step_paths=[])
    peak, phase = 0, "initialising"
    try:
        _phase(phase, started)
        # Each system initialises its variables as its user would: through the session it
        # runs steps with.  tfmem then releases the initializer's executor, and with it
        # the zeros and ones TensorFlow would keep beside the variables (first_updates).
        runner.run(model.init)
        # which steps of the training request plan it (again): tfmem's re-plans
        watch = steady.ReplanWatch(runner) if system == "tfmem" else None
        planned = []  # per step: did it begin by planning?
        memory = accelerator.device_memory("CPU:0")
        result["resident_after_init_bytes"] = memory["current"] if memory else None
        accelerator.reset_peak("CPU:0")
        step = 0
        while not steady.done(planned, args.steps, args.max_steps, args.steady_steps):
            phase = f"step {step}"
            _phase(phase, started)
            step_started = time.perf_counter()
            try:
                _, loss = runner.run([model.train_op, model.loss], feed_dict=model.feed)
            finally:
                memory = accelerator.device_memory("CPU:0")
                if memory is not None:
                    peak = max(peak, memory["peak"])
            result["step_times"].append(time.perf_counter() - step_started)
            if system == "tfmem":  # which path the step took (see --partial-runs)
                result["tfmem"]["step_paths"].append(
                    "partial run" if runner.last_step.partial_run else "callables")
            result["losses"].append(float(loss))
            result["step_peaks"].append(memory["peak"] if memory else None)
            result["resident_after_steps_bytes"] = memory["current"] if memory else None
            # plain TensorFlow: only its first step sets the request up
            planned.append(watch.planned[step] if watch and len(watch.planned) > step
                           else step == 0)
            step += 1
        result["status"], result["ok"] = "ok", True
    except tf.errors.ResourceExhaustedError as err:  # tfmem's DeviceMemoryError is one too
        result["status"] = "oom"
        result["error"] = f"{type(err).__name__}: {_first_line(err.message)}"
    except tfmem.BudgetError as err:
        result["status"], result["error"] = "budget", str(err)
    except tfmem.HostMemoryError as err:
        result["status"], result["error"] = "host-memory", str(err)
    except Exception as err:  # pylint: disable=broad-except
        # Not "does not fit": a bug or a broken setup.  The search reports it as a
        # failure of the run (is_size_limit), never as a size limit.
        result["status"], result["error"] = "error", f"{type(err).__name__}: {_first_line(err)}"
    if not result["ok"]:
        result["failed_in"] = phase
    result["peak_bytes"] = peak or None
    times = result["step_times"]
    result["steps"] = len(times)
    result.update(steady.split(times, planned, watch.compiled if watch else None,
                               args.steady_steps))
    result["steady_ms_per_unit"] = steady.ms_per_unit(result["steady_seconds"], args.size,
                                                      model.examples)
    if result["steady_seconds"]:
        result["throughput"] = model.examples / result["steady_seconds"]
    if system == "tfmem" and runner.last_step is not None:
        stats = runner.last_step
        info = result["tfmem"]
        info.update(partitions=stats.partitions, swapped_out_bytes=stats.swapped_out_bytes,
                    host_buffer_bytes=stats.host_buffer_bytes, host_rss_bytes=stats.host_rss_bytes,
                    prefetch_wait_seconds=stats.prefetch_wait_time, last_step=str(stats),
                    last_compile=str(runner.last_compile) if runner.last_compile else None)
        if result["ok"]:
            plan = runner.plan([model.train_op, model.loss], feed_dict=model.feed)
            report = runner.memory_report()
            info.update(plan_partition_size=plan.partition_size,
                        predicted_peak_bytes=report.predicted_device_peak)
    if system == "tfmem":
        runner.close()
    else:
        sess.close()
    result["seconds"] = time.perf_counter() - started
    _phase("done", started)
    return result


def describe_trial(result):
    """One line about a trial, for people (with the trial's own time when known)."""
    size = f"{result['size_name']}={result['size']}"
    seconds = result.get("process_seconds") or result.get("seconds")
    took = f" [{seconds:.0f} s]" if seconds else ""
    if result.get("ok"):
        peak = result.get("peak_bytes")
        text = f"{result['system']} {size}: trained {len(result['step_times'])} steps"
        if result.get("first_step_seconds") is not None:
            text += f", first {result['first_step_seconds']:.2f} s"
        if result.get("replans"):
            text += f", {result['replans']} re-plans"
        text += (f", steady {result['steady_seconds']:.3f} s" if result.get("steady_seconds")
                 else ", steady state not measured" if "steady_seconds" in result
                 else f", {result['throughput']:.2f} {result.get('unit', 'examples')}/s"
                 if result.get("throughput") else ", no step after the first timed")
        text += f", peak {peak / MIB:.1f} MiB" if peak else ""
        info = result.get("tfmem") or {}
        if info.get("partitions"):
            text += (f", {info['partitions']} partitions, "
                     f"{info['swapped_out_bytes'] / MIB:.0f} MiB swapped out")
        return text + took
    kind = result.get("status")
    if kind and not is_size_limit(result):
        kind = f"FAILURE ({kind})"
    return f"{result['system']} {size}: {kind} {result.get('error') or ''}".strip() + took


# --------------------------------------------------------------------------
# one trial, in a child process


def _stderr_tail(text, lines=12):
    keep = [line for line in text.strip().splitlines()
            if not line.startswith(("I0000", "W0000", "WARNING: All log", PHASE))
            and "cuInit" not in line]
    return "\n".join(keep[-lines:])


def _last_phase(text):
    """(phase, seconds into the trial) of the last PHASE line in a trial's stderr."""
    for line in reversed((text or "").splitlines()):
        if line.startswith(PHASE + " "):
            name, _, seconds = line[len(PHASE) + 1:].rpartition(" ")
            return name, float(seconds)
    return None, None


def spawn_trial(experiment, args, system, size, timeout):
    """Run one trial in a fresh process (the cap is set there before TensorFlow starts).

    Returns the trial's dict; a process that times out, crashes or prints no
    result gets status timeout, crash or error.
    """
    cmd = [sys.executable, str(Path(experiment.script).resolve()), "--system", system,
           f"--{experiment.size.replace('_', '-')}", str(size)] + trial_options(experiment, args)
    # The cap (or, without one, the same BFC allocator far above the step, so that
    # figures exist on every kernel path) and the kernel path, both set explicitly.
    onednn = bool(args.onednn) and is_tfmem(system)
    env = child_env.child_env(cap_mib=args.device_memory, onednn=onednn)
    started = time.perf_counter()
    base = dict(experiment=experiment.name, system=system, size_name=experiment.size,
                size=size, index=experiment.index_of(size), batch_size=args.batch_size,
                device_memory_mib=args.device_memory, kernel_path=child_env.kernel_path(onednn),
                ok=False, command=cmd)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the trial's own process group
        stdout, stderr = proc.communicate()
        phase, at = _last_phase(stderr)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if lines:
            # The trial finished and printed its result within the limit; only the
            # process's exit (TensorFlow's teardown, seconds on a loaded machine) ran over.
            result = json.loads(lines[-1])
            result.update(command=cmd, process_seconds=time.perf_counter() - started,
                          unit=experiment.unit, killed_after_result=True)
            return result
        return dict(base, status="timeout", seconds=time.perf_counter() - started,
                    failed_in=phase, error=f"no result within {timeout:.0f} s"
                    + (f" (still in {phase}, begun at {at:.0f} s)" if phase else ""))
    elapsed = time.perf_counter() - started
    phase, at = _last_phase(stderr)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        result = json.loads(lines[-1])
        result.update(command=cmd, process_seconds=elapsed, unit=experiment.unit)
        return result
    if proc.returncode < 0:
        return dict(base, status="crash", seconds=elapsed, returncode=proc.returncode,
                    failed_in=phase, error=child_env.describe_exit(proc.returncode)
                    + (f" in {phase}" if phase else ""), stderr_tail=_stderr_tail(stderr))
    return dict(base, status="error", seconds=elapsed, returncode=proc.returncode,
                failed_in=phase, error=f"exit {proc.returncode} without a result"
                + (f" (in {phase})" if phase else ""), stderr_tail=_stderr_tail(stderr))


# --------------------------------------------------------------------------
# the search


class Progress:
    """A one-line text progress bar on stderr (a line per update when not a terminal).

    The bar fills with the larger of trials used / max_trials and search time
    used / search_time: whichever budget ends the search first.
    """

    def __init__(self, label, max_trials, search_time=None, stream=None, width=24):
        self.label, self.max_trials, self.search_time = label, max_trials, search_time
        self.width = width
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.started = time.perf_counter()

    def update(self, done, text):
        elapsed = time.perf_counter() - self.started
        fraction = done / max(self.max_trials, 1)
        if self.search_time:
            fraction = max(fraction, elapsed / self.search_time)
        filled = min(self.width, round(self.width * fraction))
        line = (f"{self.label:<9}[{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done:>2} trials {int(elapsed) // 60}:{int(elapsed) % 60:02d}  {text}")
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def find_max(trial, start, sizes, max_index=None, tolerance=0.0, max_trials=40,
             search_time=None, progress=None):
    """The largest search index whose trial succeeds: exponential, then binary search.

    trial(k) -> result dict with "ok".  Doubles k from `start` until a trial
    fails (or `max_index`), then bisects between the largest success and the
    smallest failure until they are adjacent, or within `tolerance` times the
    success.  A failing start bisects downwards.  Only a failure that
    `is_size_limit` bounds the size; any other failure stops the search at
    once (stopped "failure", the trial in `failure`).  Returns a dict: best
    (index or 0), failed_at (smallest index that did not fit, or None),
    trials (in order), stopped (why the search ended early, or None),
    failure, seconds.
    """
    started = time.perf_counter()
    trials, results = [], {}
    low, high, stopped, failure = 0, None, None, None

    def run(k):
        nonlocal low, high, stopped, failure
        result = trial(k)
        results[k] = result
        trials.append(result)
        if result.get("ok"):
            low = max(low, k)
        elif is_size_limit(result):
            high = k if high is None else min(high, k)
        else:
            stopped, failure = "failure", result
        if progress:
            bracket = f"[{sizes(low) if low else '-'}, {sizes(high) if high else '?'})"
            progress(len(trials), f"{describe_trial(result)}  bracket {bracket}")
        return result

    def out_of_budget():
        nonlocal stopped
        if stopped is not None:
            return True
        if len(trials) >= max_trials:
            stopped = "max-trials"
        elif search_time is not None and time.perf_counter() - started >= search_time:
            stopped = "search-time"
        return stopped is not None

    k = start if max_index is None else min(start, max_index)
    while not out_of_budget():
        if not run(k).get("ok"):
            break
        if max_index is not None and k >= max_index:
            stopped = "max-size"
            break
        k = k * 2 if max_index is None else min(k * 2, max_index)
    while high is not None and high - low > 1 and not out_of_budget():
        if low and high - low <= tolerance * low:
            break
        middle = (low + high) // 2
        run(middle)
    return dict(best=low, failed_at=high, trials=trials, stopped=stopped, failure=failure,
                seconds=time.perf_counter() - started)


def search_systems(experiment, args, out=None):
    """find_max for every requested system; a list of per-system summaries."""
    systems = args.system or list(experiment.systems)
    first = experiment.index_of(args.start) if args.start else 1
    max_index = experiment.index_of(args.max_size) if args.max_size else None
    summaries, best_so_far = [], 0
    for system in systems:
        start = max(first, best_so_far)
        bar = Progress(system, args.max_trials, args.search_time)
        outcome = find_max(
            lambda k, s=system: spawn_trial(experiment, args, s, experiment.sizes(k),
                                            args.trial_timeout),
            start, experiment.sizes, max_index=max_index, tolerance=args.tolerance,
            max_trials=args.max_trials, search_time=args.search_time, progress=bar.update)
        bar.close()
        summary = summarise(experiment, args, system, outcome)
        summaries.append(summary)
        best_so_far = max(best_so_far, outcome["best"])
        if out:
            out(format_summary(summary))
    return summaries


def summarise(experiment, args, system, outcome):
    """The report row of one system's search."""
    by_index = {t["index"]: t for t in outcome["trials"]}
    best = by_index.get(outcome["best"]) if outcome["best"] else None
    failed = by_index.get(outcome["failed_at"]) if outcome["failed_at"] else None
    failure = outcome.get("failure")
    if failure is not None:  # a failure of the run, not a limit: it says so first
        limit, failed = ("unsupported" if failure.get("status") == "unsupported"
                         else "error"), failure
    elif failed is not None:
        limit = failed["status"]
    else:
        limit = outcome["stopped"]
    info = (best or {}).get("tfmem") or {}
    return dict(
        experiment=experiment.name, system=system, label=experiment.labels[system],
        # The best trial's own batch where it has one (a Keras experiment whose size knob
        # is the batch), else the run's.
        batch_size=(best or {}).get("batch_size") or args.batch_size,
        device_memory_mib=args.device_memory,
        size_name=experiment.size, max_size=best["size"] if best else None,
        parameters=best["parameters"] if best else None,
        throughput=best["throughput"] if best else None, unit=experiment.unit,
        peak_mib=round(best["peak_bytes"] / MIB, 1) if best and best.get("peak_bytes") else None,
        state_mib=round(best["state_bytes"] / MIB, 1) if best and best.get("state_bytes") else None,
        resident_mib=(round(best["resident_after_steps_bytes"] / MIB, 1)
                      if best and best.get("resident_after_steps_bytes") else None),
        first_step_seconds=(round(best["first_step_seconds"], 1)
                            if best and best.get("first_step_seconds") is not None else None),
        replans=(best or {}).get("replans"),
        steady_step_count=(best or {}).get("steady_step_count"),
        steady_seconds=(best or {}).get("steady_seconds"),
        steady_ms_per_unit=(best or {}).get("steady_ms_per_unit"),
        work_unit=experiment.work_unit,
        first_failing_size=failed["size"] if failed else None,
        limit=limit, limit_text=LIMITS.get(limit, limit or ""),
        failure=(failed or {}).get("error"), run_failed=limit == "error",
        partitions=info.get("partitions"), swapped_out_mib=(
            round(info["swapped_out_bytes"] / MIB, 1) if info.get("swapped_out_bytes") is not None
            else None),
        trials=len(outcome["trials"]), search_seconds=round(outcome["seconds"], 1),
        stopped=outcome["stopped"], all_trials=outcome["trials"])


def format_summary(summary):
    if summary["max_size"] is None:
        head = f"{summary['system']}: nothing trained"
    else:
        steady_seconds = summary.get("steady_seconds")
        head = (f"{summary['system']}: max {summary['size_name']} {summary['max_size']} "
                f"({summary['parameters']:,} parameters, first step "
                f"{summary['first_step_seconds']} s, {summary.get('replans') or 0} re-plans, "
                + (f"steady step {steady_seconds:.3f} s)" if steady_seconds
                   else "steady state not measured)"))
    after = (f"; {summary['size_name']} {summary['first_failing_size']} failed: "
             f"{summary['limit_text']}" if summary["first_failing_size"] else
             (f"; search stopped: {summary['limit_text']}" if summary["limit"] else ""))
    return f"{head}{after}; {summary['trials']} trials in {summary['search_seconds']:.0f} s"


# --------------------------------------------------------------------------
# reports

COLUMNS = ("system", "batch", "max_size", "parameters", "first_step_seconds", "replans",
           "steady_seconds", "throughput", "steady_ms_per_unit", "vs_plain", "peak_mib",
           "resident_mib", "state_mib", "partitions", "first_failing_size", "limit", "failure",
           "trials", "search_seconds")


def _rounded(value, digits):
    return None if value is None else round(value, digits)


def vs_plain(summary, summaries):
    """A system's steady cost per unit of work at its maximum size over plain TensorFlow's
    at plain's maximum size, or None when either was not measured."""
    plain = next((s for s in summaries if s["system"] == "tf"), None)
    mine, theirs = summary.get("steady_ms_per_unit"), (plain or {}).get("steady_ms_per_unit")
    return mine / theirs if mine and theirs else None


def table_rows(summaries):
    """Flat rows (COLUMNS) of the per-system summaries.  Throughput is batch over the
    steady-state step; summaries without steady-state figures have none of these (None)."""
    rows = []
    for s in summaries:
        steady_seconds = s.get("steady_seconds")
        rows.append(dict(
            system=s["system"], batch=s["batch_size"], max_size=s["max_size"],
            parameters=s["parameters"], first_step_seconds=s["first_step_seconds"],
            replans=s.get("replans"), steady_seconds=_rounded(steady_seconds, 3),
            throughput=_rounded(s["batch_size"] / steady_seconds if steady_seconds else None, 2),
            steady_ms_per_unit=_rounded(s.get("steady_ms_per_unit"), 4),
            vs_plain=_rounded(vs_plain(s, summaries), 2),
            peak_mib=s["peak_mib"], resident_mib=s["resident_mib"], state_mib=s["state_mib"],
            partitions=s["partitions"], first_failing_size=s["first_failing_size"],
            limit=s["limit_text"], failure=s["failure"], trials=s["trials"],
            search_seconds=s["search_seconds"]))
    return rows


def _cell(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _ms(value):
    """Milliseconds per unit of work with three significant digits (they span 1e-3..10)."""
    return "-" if value is None else f"{value:.3g}"


def markdown_table(summaries, size_name, unit, work_unit=None):
    """The paper-shaped table (system, batch, max size, parameters) with each system's
    first step, re-plans and steady state at its maximum size, and context.  A summary
    without steady-state figures shows "-" there (not measured)."""
    work_unit = work_unit or next((s["work_unit"] for s in summaries if s.get("work_unit")),
                                  f"{size_name}-example")
    head = ["system", "batch", f"max {size_name}", "parameters", "first step s", "re-plans",
            "steady step s", f"steady {unit}/s", f"steady ms per {work_unit}",
            "vs plain at plain's max", "peak MiB", "resident MiB", "state MiB", "partitions",
            f"first failing {size_name}", "what stopped it", "trials", "search s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table_rows(summaries):
        cells = [_cell(c) for c in (row["system"], row["batch"], row["max_size"],
                                    row["parameters"], row["first_step_seconds"], row["replans"])]
        cells += ["-" if row["steady_seconds"] is None else f"{row['steady_seconds']:.3f}",
                  _cell(row["throughput"]), _ms(row["steady_ms_per_unit"]),
                  "-" if row["vs_plain"] is None else f"{row['vs_plain']:.2f}x"]
        cells += [_cell(c) for c in (row["peak_mib"], row["resident_mib"], row["state_mib"],
                                     row["partitions"], row["first_failing_size"], row["limit"],
                                     row["trials"], row["search_seconds"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(summaries, path, title, notes=()):
    size_name = summaries[0]["size_name"] if summaries else "size"
    unit = summaries[0]["unit"] if summaries else "examples"
    text = [f"# {title}", "", markdown_table(summaries, size_name, unit), ""]
    text += [f"- {note}" for note in notes]
    Path(path).write_text("\n".join(text).rstrip() + "\n")


def write_csv(summaries, path):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table_rows(summaries))


TRIAL_COLUMNS = ("system", "size", "status", "parameters", "throughput", "peak_mib",
                 "first_step_seconds", "replans", "steady_seconds", "steady_ms_per_unit",
                 "steps", "seconds", "partitions", "error")


def write_trials_csv(summaries, path):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=TRIAL_COLUMNS)
        writer.writeheader()
        for summary in summaries:
            for t in summary["all_trials"]:
                writer.writerow(dict(
                    system=t["system"], size=t["size"], status=t.get("status"),
                    parameters=t.get("parameters"),
                    throughput=None if t.get("throughput") is None else round(t["throughput"], 3),
                    peak_mib=round(t["peak_bytes"] / MIB, 1) if t.get("peak_bytes") else None,
                    first_step_seconds=(None if t.get("first_step_seconds") is None
                                        else round(t["first_step_seconds"], 2)),
                    replans=t.get("replans"),
                    steady_seconds=_rounded(t.get("steady_seconds"), 4),
                    steady_ms_per_unit=_rounded(t.get("steady_ms_per_unit"), 5),
                    steps=len(t.get("step_times") or []) or None,
                    seconds=round(t.get("process_seconds") or t.get("seconds") or 0, 1),
                    partitions=(t.get("tfmem") or {}).get("partitions"),
                    error=(t.get("error") or "")[:200]))


def pyplot():
    """matplotlib.pyplot drawing to files (Agg), or None when matplotlib is missing."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return plt


def write_plot(summaries, path, title):
    """Size against throughput of every trial that trained, one line per system.

    Returns None when written, else a note saying why not (matplotlib missing).
    """
    plt = pyplot()
    if plt is None:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    if not any(t.get("ok") and t.get("throughput") for s in summaries for t in s["all_trials"]):
        return "no plot: no trial trained"
    from matplotlib.ticker import ScalarFormatter  # pylint: disable=import-outside-toplevel
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for summary in summaries:
        points = sorted((t["size"], t["throughput"]) for t in summary["all_trials"]
                        if t.get("ok") and t.get("throughput"))
        line, = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                          label=f"{summary['system']} (max {summary['max_size'] or '-'})")
        if summary["first_failing_size"]:
            axis.axvline(summary["first_failing_size"], linestyle=":", linewidth=1,
                         color=line.get_color())
    unit = summaries[0]["unit"] if summaries else "examples"
    axis.set_xlabel((summaries[0]["size_name"] if summaries else "size")
                    + "  (dotted: smallest size that failed)")
    axis.set_ylabel(f"steady-state throughput ({unit}/s, log scale)")
    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_formatter(ScalarFormatter())
    axis.set_xlim(left=0)
    axis.set_title(title, fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def result_line(summaries, reason=None, baseline="tf"):
    """RESULT system=tfmem max=<size> ratio=<tfmem max / baseline max>[ reason="..."].

    `reason`: why the run has no trustworthy result (a failure of the run), if so.
    """
    by_system = {s["system"]: s for s in summaries}
    tfm, plain = by_system.get("tfmem"), by_system.get(baseline)
    best = tfm["max_size"] if tfm else None
    ratio = (f"{best / plain['max_size']:.2f}" if best and plain and plain["max_size"]
             else "n/a")
    line = f"RESULT system=tfmem max={best if best is not None else 'none'} ratio={ratio}"
    if reason:
        line += ' reason="' + " ".join(str(reason).split()).replace('"', "'") + '"'
    return line


def run_failure(summaries):
    """Why the run's result cannot be trusted (a search that failed), or None."""
    failed = [s for s in summaries if s.get("run_failed")]
    if failed:
        return "; ".join(f"{s['system']} failed at {s['size_name']}={s['first_failing_size']}: "
                         f"{s['failure']}" for s in failed)
    tfm = {s["system"]: s for s in summaries}.get("tfmem")
    if tfm is not None and not tfm["max_size"]:
        return f"tfmem trained no size ({tfm['limit_text']}: {tfm['failure']})"
    return None


# --------------------------------------------------------------------------
# the cap, derived on this machine, and where a result comes from


CAP_TRIALS = 3  # plain processes whose median peak makes the cap (see derive_cap)


def derive_cap(experiment, args, out=None):
    """The cap from plain TensorFlow's measured peak at --cap-base, on this machine.

    Plain trials (oneDNN off, the BFC allocator without a cap) at `args.cap_base`,
    CAP_TRIALS of them: the peak moves by a few tenths of a MiB between processes, and
    the rounding up to a MiB would turn that into a whole MiB.  The cap is the median
    peak times `args.cap_factor`, rounded up to a MiB.  Returns a dict (base size, the
    peaks, the median, factor, cap, kernel path, the median trial), with `cap_mib` None
    and an `error` when a trial failed.
    """
    uncapped = argparse.Namespace(**vars(args))
    uncapped.device_memory = None
    measured, failed = [], None
    while len(measured) < CAP_TRIALS and failed is None:
        trial = spawn_trial(experiment, uncapped, experiment.baseline, args.cap_base,
                             args.trial_timeout)
        if trial.get("ok") and trial.get("peak_bytes"):
            measured.append(trial)
        else:
            failed = trial
    measured.sort(key=lambda t: t["peak_bytes"])
    trial = failed or measured[CAP_TRIALS // 2]
    info = dict(base_size=args.cap_base, size_name=experiment.size, factor=args.cap_factor,
                kernel_path=trial.get("kernel_path"), plain_peak_mib=None, cap_mib=None,
                plain_peaks_mib=[round(t["peak_bytes"] / MIB, 2) for t in measured],
                error=None, trial=trial)
    if failed is None:
        info["plain_peak_mib"] = round(trial["peak_bytes"] / MIB, 2)
        info["cap_mib"] = -(-int(trial["peak_bytes"] * args.cap_factor) // MIB)
    else:
        info["error"] = (f"plain TensorFlow at {experiment.size}={args.cap_base} without a cap: "
                         f"{describe_trial(dict(failed, unit=experiment.unit))}")
    if out:
        out(f"cap: plain TensorFlow's peak at {experiment.size}={args.cap_base} "
            f"({info['kernel_path']}, no cap): "
            + (f"{info['plain_peak_mib']} MiB, the median of {info['plain_peaks_mib']} -> cap "
               f"{info['cap_mib']} MiB (x{args.cap_factor:g}, rounded up)"
               if info["cap_mib"] else info["error"]))
    return info


def allocator_note(kind):
    """How every system's emulated device held its memory, in one line."""
    if kind == "one-region":
        return ("allocator: every trial (plain TensorFlow's too, and the cap's base trial) "
                "first reserves its cap as one region (tfmem.reserve_emulated_memory), as a "
                "GPU's allocator holds its memory")
    return ("allocator: TensorFlow's CPU allocator as it grows (regions of 2, 4, 8 ... MiB, "
            "the last one what the cap leaves)")


def session_config_note(kind):
    """Which session config every system's trials ran under, in one line."""
    if kind == "tfmem":
        return ("sessions: every system's session (plain TensorFlow's too, and the cap's "
                "base trial) runs tfmem.session_config(): Grappler's meta optimizer off, so "
                "grappler = tf, and tfmem plans sums without the regrouping rule")
    return "sessions: TensorFlow's default session config for every system"


def cap_note(experiment, args, cap_info):
    """How the cap was chosen, in one line."""
    if cap_info is None:
        return f"cap: {args.device_memory} MiB, given (--device-memory)"
    if cap_info.get("note"):
        return f"cap: {cap_info['note']}"
    return (f"cap: {cap_info['cap_mib']} MiB = plain TensorFlow's peak at {experiment.size} "
            f"{cap_info['base_size']} measured on this machine ({cap_peak_text(cap_info)}, "
            f"{cap_info['kernel_path']}, BFC allocator without a cap) x "
            f"{cap_info['factor']:g}, rounded up")


def cap_peak_text(cap_info):
    """The plain peak a cap was derived from, and the peaks it is the median of (results
    before CAP_TRIALS have one)."""
    peaks = cap_info.get("plain_peaks_mib") or []
    if len(peaks) > 1:
        return (f"{cap_info['plain_peak_mib']} MiB, the median of "
                + ", ".join(f"{p:g}" for p in peaks) + " in as many processes")
    return f"{cap_info['plain_peak_mib']} MiB"


def provenance(args, started_from=None, systems=SYSTEMS):
    """What produced a result: commit (`started_from`: the code the run started from),
    TensorFlow version, each system's kernel path, cores, date."""
    return tfmem_provenance.provenance(
        {system: child_env.kernel_path(bool(args.onednn) and is_tfmem(system))
         for system in systems}, started_from)


def provenance_note(info):
    return tfmem_provenance.describe(info)


def output_stem(experiment, args):
    """results/<model>-<tag>, the directory created: every output's path without suffix."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("quick" if args.quick else f"cap{args.device_memory}-b{args.batch_size}")
    if not args.tag and getattr(args, "state_share", None):  # the Keras experiments' setting
        tag += f"-state{args.state_share:g}"
    return out_dir / f"{experiment.name}-{tag}"


def step_path_text(settings):
    """How tfmem's trials ran their steps (--partial-runs, --measure), in a few words."""
    measure = settings.get("measure") or "sample"
    if settings.get("partial_runs"):
        if measure == "off":
            return "partial runs (measure off: no step measured, budget mode learns nothing)"
        if settings.get("partition_size") == "auto" or settings.get("budget") is not None:
            return (f"partial runs (measure {measure}: budget mode measures them by "
                    "TensorFlow's process peak around each call and learns)")
        return f"partial runs (measure {measure}: measured steps run callables)"
    return f"callables (measure {measure})"


def steps_note(args):
    """How many steps each trial ran, in a few words."""
    if args.steps is not None:
        return f"{args.steps} steps per trial"
    return (f"steps per trial: until {args.steady_steps} follow the last re-plan, at most "
            f"{args.max_steps}")


def command_line(experiment, argv=None):
    """The command that ran this search, as typed (script path relative to the repository)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"python experiments/{Path(experiment.script).name}"] + args)


def write_reports(experiment, args, summaries, seconds, out=print, extra=None, cap_info=None,
                  started_from=None):
    """Markdown, CSV, trials CSV, JSON and PNG under args.out_dir; returns the paths.
    `started_from`: the provenance source() read when the search started."""
    stem = output_stem(experiment, args)
    origin = provenance(args, started_from, experiment.systems)
    cap = f"{args.device_memory} MiB" if args.device_memory else "no cap"
    title = f"{experiment.title}: largest {experiment.size} under {cap}, batch {args.batch_size}"
    model = ", ".join(f"{name.replace('_', ' ')} {getattr(args, name)}"
                      for name in experiment.model_args)
    tfmem_mode = (f"partition_size=auto (budget mode, budget "
                  f"{args.budget or args.device_memory} MiB)"
                  if args.partition_size == "auto" else f"partition_size={args.partition_size}")
    notes = [f"model: {model}; {steps_note(args)}; each system at its own max size: the first "
             "step, the re-plans after it (tfmem: steps that planned the request again), the "
             f"steady-state step = the median of the steps after the last re-plan (at least "
             f"{args.steady_steps}), throughput = batch / steady step, ms per "
             f"{experiment.work_unit} = steady step / ({experiment.size} x batch), and that "
             "over plain TensorFlow's at plain's own max size",
             *(experiment.system_notes(args) if experiment.system_notes else (
                 f"systems: tf = TensorFlow defaults; grappler = memory_optimization "
                 f"{GRAPPLER_MEMORY_OPTIMIZATION}; tfmem = TFMemSession {tfmem_mode}, swap "
                 f"{args.swap}, swap_distance {args.swap_distance}, prefetch {args.prefetch}, "
                 f"{step_path_text(vars(args))}", session_config_note(args.session_config))),
             allocator_note(args.allocator),
             f"search: exponential then binary on {experiment.size}, one process per trial, "
             f"trial time limit {args.trial_timeout:.0f} s, tolerance {args.tolerance:g}; "
             f"whole run {seconds:.0f} s",
             "peak MiB: TensorFlow's allocator peak over the steps at the max size; resident "
             "MiB: what the allocator still holds after the last step; state MiB: the variables "
             "(weights, momentum, moving averages), which stay on the emulated device",
             cap_note(experiment, args, cap_info), provenance_note(origin)]
    for summary in summaries:
        if summary["first_failing_size"]:
            notes.append(f"{summary['system']} at {experiment.size} "
                         f"{summary['first_failing_size']}: {summary['failure']}")
    notes.append(result_line(summaries, run_failure(summaries), experiment.baseline))
    note = write_plot(summaries, f"{stem}.png", title)
    if note:
        notes.append(note)
    write_markdown(summaries, f"{stem}.md", title, notes)
    if extra is not None:
        with open(f"{stem}.md", "a") as handle:
            handle.write("\n" + extra.markdown.rstrip() + "\n")
    write_csv(summaries, f"{stem}.csv")
    write_trials_csv(summaries, f"{stem}-trials.csv")
    with open(f"{stem}.json", "w") as handle:
        json.dump(dict(command=command_line(experiment),
                       settings={k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()},
                       provenance=origin, cap=cap_info, title=title,
                       notes=notes, result=result_line(summaries, run_failure(summaries),
                                                       experiment.baseline),
                       seconds=seconds, summaries=summaries,
                       extra=extra.data if extra is not None else None,
                       extra_markdown=extra.markdown if extra is not None else None),
                  handle, indent=1)
    paths = [f"{stem}.md", f"{stem}.csv", f"{stem}-trials.csv", f"{stem}.json"]
    if not note:
        paths.append(f"{stem}.png")
    else:
        out(note)
    return paths + list(extra.paths if extra is not None else ())


# --------------------------------------------------------------------------
# entry point


def main(experiment, argv=None):
    """The experiment script's command line; returns the exit code."""
    args = parse_args(experiment, argv)
    if not args.find_max:
        # Before TensorFlow is imported: the cap, or without one the same BFC
        # allocator far above the step, so that it keeps figures on every kernel path.
        if args.device_memory is not None:
            tfmem.emulate_accelerator(args.device_memory)
        elif accelerator.emulated_memory_mib() is None:
            tfmem.emulate_accelerator(child_env.MEASURE_LIMIT_MIB)
        result = (experiment.trial or run_trial)(experiment, args)
        result["unit"] = experiment.unit
        print(describe_trial(result), file=sys.stderr)
        print(json.dumps(result), flush=True)
        return 0 if result["ok"] else 3
    try:
        with shared_kernel_figures():
            return _search_and_report(experiment, args)
    except Exception as err:  # pylint: disable=broad-except
        # Whatever happens, the run ends with a clear message and its RESULT line.
        print(f"{experiment.title}: the run stopped: {type(err).__name__}: {err}", flush=True)
        print(result_line([], reason=f"the run stopped: {type(err).__name__}: {err}"),
              flush=True)
        return 1


# tfmem.memory.scratch.CACHE_ENV (not imported: this process runs no TensorFlow).
SCRATCH_CACHE_ENV = "TFMEM_SCRATCH_CACHE"


@contextlib.contextmanager
def shared_kernel_figures():
    """The trials of one run share a kernel scratch file: each kernel configuration is
    measured once per run, by the first trial that meets it, instead of in every trial's
    process (calibrated apart from any process's allocations, the figures are the same
    wherever measured).  A TFMEM_SCRATCH_CACHE the user set is kept."""
    if os.environ.get(SCRATCH_CACHE_ENV):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tfmem-kernels-") as directory:
        os.environ[SCRATCH_CACHE_ENV] = os.path.join(directory, "scratch.json")
        try:
            yield
        finally:
            del os.environ[SCRATCH_CACHE_ENV]


def _search_and_report(experiment, args):
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    started, started_from = time.perf_counter(), tfmem_provenance.source()
    cap_info = None
    if args.device_memory is None:
        cap_info = (experiment.derive_cap or derive_cap)(experiment, args, out=say)
        if cap_info["cap_mib"] is None:
            print(f"{experiment.title}: no cap, so no search: {cap_info['error']}")
            print(result_line([], reason=f"deriving the cap failed: {cap_info['error']}"),
                  flush=True)
            return 1
        args.device_memory = cap_info["cap_mib"]
    say(f"{experiment.title}: searching the largest {experiment.size} under "
        f"{args.device_memory} MiB, batch {args.batch_size}, {steps_note(args)}, "
        f"trial limit {args.trial_timeout:.0f} s; plain TensorFlow "
        f"{child_env.kernel_path(False)}, tfmem {child_env.kernel_path(bool(args.onednn))}")
    summaries = search_systems(experiment, args, out=say)
    extra = (experiment.report(args, summaries, output_stem(experiment, args), out=say)
             if experiment.report else None)
    seconds = time.perf_counter() - started
    paths = write_reports(experiment, args, summaries, seconds,
                          out=lambda line: print(line, file=sys.stderr), extra=extra,
                          cap_info=cap_info, started_from=started_from)
    print(markdown_table(summaries, experiment.size, experiment.unit, experiment.work_unit))
    print()
    if extra is not None:
        print(extra.markdown.rstrip())
        print()
    print(cap_note(experiment, args, cap_info))
    print(f"outputs: {', '.join(str(p) for p in paths)}")
    print(f"total time: {seconds:.0f} s")
    reason = run_failure(summaries)
    if reason:
        print(f"NO RESULT: {reason}")
    print(result_line(summaries, reason, experiment.baseline), flush=True)
    return 1 if reason else 0
