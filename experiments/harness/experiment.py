"""What an experiment script describes (its model, size knob and systems) and the
vocabulary of trial outcomes every other part of the harness reads."""

import dataclasses
from pathlib import Path

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
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
SYSTEM_LABELS = {"tf": "TensorFlow",
                 "grappler": f"TensorFlow + Grappler memory optimizer ({GRAPPLER_MEMORY_OPTIMIZATION})",
                 "tfmem": "tfmem (TFMemSession)"}
# How a failed trial is described in the reports: what limited the system there.
LIMITS = {"oom": "device memory (ResourceExhaustedError)",
          "crash": "a crash at the cap (the process died, no ResourceExhaustedError)",
          "budget": "device memory (tfmem: nothing fits the budget)",
          "host-memory": "host memory (tfmem refused the plan)",
          "timeout": "time (trial time limit)",
          "memory-wait": "device memory (TensorFlow's allocator waited for memory, the CPU idle)",
          "error": "FAILURE of the run (not a size limit)",
          "unsupported": "the system refused the model (its error is the result)",
          "search-time": "time (search time limit)",
          "max-size": "the --max-size limit",
          "max-trials": "the --max-trials limit"}
# Trial outcomes that mean "this size does not fit" (or, for timeout, "not in the time
# given") and may end a search as its limit.  Anything else (an exception of another
# kind, a tfmem process that crashed, a child without a result) is a failure of the run:
# the search stops and says so, it never passes for a size limit.
SIZE_LIMITS = ("oom", "budget", "host-memory", "memory-wait", "timeout")
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
