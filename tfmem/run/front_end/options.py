"""tfmem.Options: the knobs few programs need, in one value both front ends take.

    tfs = tfmem.TFMemSession(sess, partition_size=200,
                             options=tfmem.Options(measure="every", partial_runs=True))
    step = tfmem.function(fn, device_memory_budget="2GiB",
                          options=tfmem.Options(profile_peaks=True))

The everyday settings (partition_size, device_memory_budget, swap,
swap_distance, prefetch, trace) stay keyword arguments of `TFMemSession`,
`tfmem.Session`, `tfmem.function` and `tfmem.keras.partitioned`; everything
else is a field here.  A field only one front end reads, set to anything but
its default on the other, is refused (ValueError), so a setting never does
nothing silently.  The fields' old spellings as keyword arguments still work
and warn (DeprecationWarning) with the new spelling.
"""

import dataclasses
import numbers
import warnings

from tfmem.run.measuring import sampling

SESSION = "TFMemSession"
FUNCTION = "tfmem.function"


@dataclasses.dataclass(frozen=True)
class Options:
    """Rarely changed settings of a TFMemSession or tfmem.function; checked when made."""

    swap_min_bytes: int = 1 << 20
    """In swap="auto", tensors smaller than this stay on the device; also the size from
    which the placement pass moves constants to the host."""

    place_state_on_host: bool = True
    """TFMemSession: on a session with an accelerator, set the device of variables and
    of constants of at least swap_min_bytes to the host CPU before the session places
    them, so the accelerator holds them only while a partition reads them.  False
    changes no op."""

    accelerator_device: str | None = None
    """TFMemSession: the device the placement pass moves state off; None takes the
    session's first GPU or TPU."""

    atomic_updates: bool | None = None
    """TFMemSession: run every update op and what depends on it in the last partition,
    so a failed step applies all of its updates or none.  None: on for a session on
    TensorFlow's distributed runtime, off for a local one."""

    measure: str = "sample"
    """TFMemSession: which steps read TensorFlow's allocator figures: "sample" (the first
    steps of each plan until three agree, then one in 50), "every", or "off" (budget mode
    then learns nothing)."""

    partial_runs: bool = False
    """TFMemSession: run each step as one DirectSession partial run (a much cheaper first
    step on large graphs; a step that fails inside TensorFlow cancels the session)."""

    chain_copies: bool = True
    """TFMemSession: each partition's copies run one after another in the planned order
    (one kernel at a time, one peak in every process; not in budget mode nor on a
    distributed session).  False leaves their order to TensorFlow's executor, as a plain
    step runs its ops."""

    stretches: bool = True
    """TFMemSession: consecutive partitions with nothing to do between them (no swap,
    no upload, no result) run in one Session call; False runs one call per partition."""

    one_import: bool = True
    """TFMemSession: a plan's copies are added to the session's graph in one import;
    False adds them partition by partition (and runs no stretches)."""

    calls_by_name: bool = False
    """TFMemSession: run each call through `Session.run` by name (run/executing/c_path.py),
    so measured, untraced and traced steps share the executors TensorFlow built on the
    first step; False makes a session callable per run options, built again when
    measuring stops (keeping the traced ones costs about 35 % of a ResNet step).  Off by
    default: by name, the oneDNN pool net of tests/test_simulate.py at partition size 50
    leaves its 2 MiB first region one free chunk of 1.84 MB between steps, which the next
    step's 0.97 MB convolution output takes whole (the allocator splits no chunk smaller
    than twice a request): 1.94 MB more on every step after the first than the chunk
    replay predicts; and budget mode learned differently from a step out of memory
    (tests/test_oom_run_again.py)."""

    profile_peaks: bool = False
    """tfmem.function: measure every partition's device peak on every step with
    TensorFlow's profiler (costs tens to hundreds of milliseconds a step)."""

    def __post_init__(self):
        size = self.swap_min_bytes
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 0:
            raise ValueError(f"Options.swap_min_bytes must be an integer >= 0, got {size!r}")
        sampling.check_mode(self.measure)
        for name in ("place_state_on_host", "partial_runs", "chain_copies", "stretches",
                     "one_import", "calls_by_name", "profile_peaks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Options.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        if self.atomic_updates not in (None, True, False):
            raise ValueError(f"Options.atomic_updates must be None, True or False, "
                             f"got {self.atomic_updates!r}")
        if self.accelerator_device is not None and not isinstance(self.accelerator_device, str):
            raise ValueError(f"Options.accelerator_device must be a device name such as "
                             f"'GPU:0' or None, got {self.accelerator_device!r}")


# The fields each front end reads (swap_min_bytes: both).
_READ_BY = {SESSION: frozenset(f.name for f in dataclasses.fields(Options)) - {"profile_peaks"},
            FUNCTION: frozenset({"swap_min_bytes", "profile_peaks"})}


def resolve(options, deprecated, front_end, caller=None, stacklevel=3):
    """The Options a front end runs with: `options` (None: the defaults) with
    `deprecated`, the old keyword spellings of its fields, applied (one warning naming
    the new spelling), and no field set that `front_end` (SESSION or FUNCTION) does not
    read.  `caller`: the name the user called (default `front_end`), for the messages."""
    caller = caller or front_end
    if options is None:
        options = Options()
    elif not isinstance(options, Options):
        raise TypeError(f"options must be a tfmem.Options, got {type(options).__name__}")
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(deprecated) - fields)
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword arguments {unknown}")
    if deprecated:
        settings = ", ".join(f"{k}={v!r}" for k, v in deprecated.items())
        warnings.warn(f"{caller}({settings}) is deprecated: pass "
                      f"options=tfmem.Options({settings})", DeprecationWarning,
                      stacklevel=stacklevel)
        options = dataclasses.replace(options, **deprecated)
    _refuse_unread(options, front_end, caller)
    return options


def _refuse_unread(options, front_end, caller):
    defaults = Options()
    for name in sorted({f.name for f in dataclasses.fields(Options)} - _READ_BY[front_end]):
        if getattr(options, name) != getattr(defaults, name):
            other = SESSION if front_end == FUNCTION else FUNCTION
            raise ValueError(f"Options.{name} is read by {other} only; {caller} would "
                             f"ignore {name}={getattr(options, name)!r}: leave it at its "
                             f"default ({getattr(defaults, name)!r})")


# The keyword arguments both front ends take besides options (tfmem.function and
# tfmem.keras.partitioned: all but a session's own).
EVERYDAY = ("partition_size", "device_memory_budget", "swap", "swap_distance", "prefetch",
            "trace")


def split_settings(settings):
    """(the everyday keyword arguments, Options of the rest) of one mapping of settings
    by their field names, as the TFMEM variable and the command line carry them; an
    "options" entry is the Options the rest are applied to."""
    everyday = {k: v for k, v in settings.items() if k in EVERYDAY}
    rest = {k: v for k, v in settings.items() if k not in EVERYDAY and k != "options"}
    return everyday, dataclasses.replace(settings.get("options") or Options(), **rest)
