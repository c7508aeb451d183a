"""Run an unmodified program with every session it creates going through tfmem.

    tfmem run --partition-size 50 train.py --epochs 3
    TFMEM="partition_size=50" python -m tfmem.autowrap train.py --epochs 3

How: before the program starts, `install` patches TensorFlow's session
classes themselves (`tensorflow.python.client.session`): `Session.__init__`
and `InteractiveSession.__init__` also start a TFMemSession wrapping the new
session, and `BaseSession.run`, `make_callable` and `close` route a session
that has one through it.  Every route to the classes resolves to these class
objects (`import tensorflow.compat.v1 as tf`, whose module object is not
`tf.compat.v1`'s; `from tensorflow.compat.v1 import Session`;
`tensorflow.python.client.session.Session`; `MonitoredTrainingSession`,
`Supervisor` and `SessionManager`, which create theirs through that module),
including modules imported after `install`.  Everything else is the real
session, of the real type: type checks, `partial_run`, context managers.
Sessions created before `install` stay plain.

Only `tfmem run` and `python -m tfmem.autowrap` install it, in their own
process; `import tfmem` never does.  The environment variable (TFMEM) is
for launchers that start `python` themselves (mpirun, a scheduler's job
script): point them at `python -m tfmem.autowrap script.py` and pass the
options in TFMEM.  No `sitecustomize` or `.pth` file: those would wrap every
Python process of the environment, including tools that never asked for it.

A request tfmem cannot plan (`UnsupportedGraphError`, raised while planning,
before anything runs) is run by the plain session and counted in the
summary, so the program still runs.
"""

import logging
import os
import runpy
import sys
import threading

from tfmem.run.placement import accelerator
from tfmem.run.front_end import options as run_options
from tfmem.errors import UnsupportedGraphError

# Nothing here imports TensorFlow before `run_program` has set an emulated
# accelerator's cap: TensorFlow reads it when it starts.

log = logging.getLogger(__name__)

ENV = "TFMEM"

# option -> parser; the TFMemSession keyword options, plus what the runner itself uses
_PARSERS = {
    "partition_size": lambda v: v if v == "auto" else int(v),
    "device_memory_budget": str,
    "swap": str,
    "swap_distance": int,
    "prefetch": int,
    "swap_min_bytes": str,  # read by _checked_sizes, once TensorFlow may start
    "place_state_on_host": lambda v: {"1": True, "true": True, "0": False,
                                      "false": False}[v.lower()],
    "trace": str,
    "device_memory": int,  # MiB: emulate an accelerator of this size (before TensorFlow starts)
    "summary_json": str,  # also write the summary as JSON here
}
_ALIASES = {"budget": "device_memory_budget"}
RUNNER_OPTIONS = ("device_memory", "summary_json")


def parse_options(text):
    """Options from `key=value,key=value` (the TFMEM variable's form)."""
    options = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        if not sep or key not in _PARSERS:
            raise ValueError(
                f"{ENV}: cannot read {item!r}; expected key=value pairs separated by commas, "
                f"keys: {', '.join(sorted(set(_PARSERS) | set(_ALIASES)))} "
                f"(for example {ENV}=partition_size=50 or {ENV}=budget=2GiB,swap=all)")
        try:
            options[key] = _PARSERS[key](value.strip())
        except (ValueError, KeyError) as error:
            raise ValueError(f"{ENV}: bad value for {key}: {value.strip()!r} ({error})") from None
    return options


def _checked_sizes(options):
    """Memory sizes read and checked (this imports TensorFlow, through tfmem.memory.budget)."""
    from tfmem.memory.budget import parse_bytes  # pylint: disable=import-outside-toplevel
    options = dict(options)
    if "swap_min_bytes" in options:
        options["swap_min_bytes"] = parse_bytes(options["swap_min_bytes"])
    if options.get("device_memory_budget") is not None:
        parse_bytes(options["device_memory_budget"])
    return options


def _routed_methods(options, recorder):
    """({(class, method name): TensorFlow's method}, {(class, method name): its
    replacement}): each replacement calls the method it replaces, and routes the steps
    of a session created while installed through that session's TFMemSession."""
    from tensorflow.python.client import session as tf_session  # pylint: disable=import-outside-toplevel
    from tfmem.run.front_end.session import TFMemSession  # pylint: disable=import-outside-toplevel
    base, plain, interactive = (tf_session.BaseSession, tf_session.Session,
                                tf_session.InteractiveSession)
    everyday, settings = run_options.split_settings(options)
    routed = ((base, "run"), (base, "make_callable"), (base, "close"), (interactive, "close"),
              (plain, "__init__"), (interactive, "__init__"))
    originals = {(cls, name): cls.__dict__[name] for cls, name in routed}

    def started(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if self.__dict__.get("tfmem") is None:
                self.tfmem = None  # the plain session runs until the TFMemSession exists
                self.tfmem = TFMemSession(self, options=settings, **everyday)
                recorder.watch(self.tfmem)
        __init__.__doc__ = init.__doc__
        return __init__

    plain_run = originals[(base, "run")]

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):  # pylint: disable=redefined-outer-name
        tfs = self.__dict__.get("tfmem")
        if tfs is None:
            return plain_run(self, fetches, feed_dict, options, run_metadata)
        try:
            return tfs.run(fetches, feed_dict, options, run_metadata)
        except UnsupportedGraphError as error:  # raised while planning: nothing ran
            log.warning("tfmem cannot run this request in partitions (%s); "
                        "the plain session runs it", error)
            recorder.on_plain_run(tfs, str(error).split("\n")[0])
            return plain_run(self, fetches, feed_dict, options, run_metadata)

    plain_make_callable = originals[(base, "make_callable")]

    def make_callable(self, fetches, feed_list=None, accept_options=False):
        tfs = self.__dict__.get("tfmem")
        if tfs is None:
            return plain_make_callable(self, fetches, feed_list, accept_options)
        return tfs.make_callable(fetches, feed_list, accept_options)

    def released(close):
        def close_routed(self):
            tfs = self.__dict__.get("tfmem")
            if tfs is not None:
                tfs._release()  # pylint: disable=protected-access
            close(self)
        close_routed.__doc__ = close.__doc__
        return close_routed

    replacements = {(base, "run"): run, (base, "make_callable"): make_callable,
                    (base, "close"): released(originals[(base, "close")]),
                    (interactive, "close"): released(originals[(interactive, "close")]),
                    (plain, "__init__"): started(originals[(plain, "__init__")]),
                    (interactive, "__init__"): started(originals[(interactive, "__init__")])}
    for (cls, name), function in replacements.items():
        function.__name__ = name
        function.__qualname__ = f"{cls.__qualname__}.{name}"
        function.__module__ = cls.__module__
        if function.__doc__ is None:
            function.__doc__ = originals[(cls, name)].__doc__
    return originals, replacements


class Installation:
    """The patched methods of one `install`; `uninstall()` puts TensorFlow's back."""

    def __init__(self, options, recorder, patched):
        self.options = options
        self.recorder = recorder
        self._patched = patched  # [(class, name, original)]

    def uninstall(self):
        with _INSTALL_LOCK:
            for cls, name, original in reversed(self._patched):
                setattr(cls, name, original)
            self._patched = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uninstall()


_INSTALL_LOCK = threading.Lock()


def install(**options):
    """Wrap every Session / InteractiveSession created from now on in this process.

    Takes TFMemSession's keyword options.  Returns an Installation (its
    `recorder` holds the per-session totals; `uninstall()` undoes it)."""
    from tfmem.cli.run_summary import RunRecorder  # pylint: disable=import-outside-toplevel
    recorder = RunRecorder()
    with _INSTALL_LOCK:
        originals, replacements = _routed_methods(options, recorder)
        patched = []
        for (cls, name), function in replacements.items():
            setattr(cls, name, function)
            patched.append((cls, name, originals[(cls, name)]))
    return Installation(options, recorder, patched)


def describe_settings(options):
    return ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def run_program(options, target, args, module=False):
    """Run `target` (a script path, or a module with module=True) as __main__ with
    `args`, every session wrapped; print the summary at exit; return the exit code."""
    options = dict(options)
    runner = {k: options.pop(k) for k in RUNNER_OPTIONS if k in options}
    if runner.get("device_memory") is not None:
        if "tensorflow" in sys.modules:
            raise RuntimeError("device_memory must be set before TensorFlow is imported")
        accelerator.emulate_accelerator(runner["device_memory"])
    try:
        options = _checked_sizes(options)
        installation = install(**options)
    except ValueError as error:
        print(f"tfmem: {error}", file=sys.stderr)
        return 2
    settings = describe_settings(options)
    sys.argv = [target, *args]
    code = 0
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, (int, type(None))):
            print(exit_.code, file=sys.stderr)
    finally:
        installation.recorder.print(settings)
        if runner.get("summary_json"):
            installation.recorder.write_json(runner["summary_json"], settings)
    return code


def main(argv=None):
    """`python -m tfmem.autowrap [-m module | script.py] [args]`, options from TFMEM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (f"usage: {ENV}=key=value,... python -m tfmem.autowrap "
             "(script.py | -m module) [args ...]")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage + "\n\n" + __doc__, file=sys.stderr)
        return 2 if not argv else 0
    try:
        options = parse_options(os.environ.get(ENV, ""))
    except ValueError as error:
        print(f"tfmem: {error}", file=sys.stderr)
        return 2
    if argv[0] == "-m":
        if len(argv) < 2:
            print(usage, file=sys.stderr)
            return 2
        return run_program(options, argv[1], argv[2:], module=True)
    return run_program(options, argv[0], argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
