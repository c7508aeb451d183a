"""An experiment script's entry point: one trial in this process (--system and a size),
or the search with its reports (--find-max, --quick)."""

import contextlib
import json
import os
import sys
import tempfile
import time

import tfmem
from tfmem.cli import child_env
from tfmem.cli import provenance as tfmem_provenance
from tfmem.run.placement import accelerator

from experiments.harness.cap import cap_note, derive_cap
from experiments.harness.options import parse_args
from experiments.harness.reports import (markdown_table, output_stem, result_line, run_failure,
                                         steps_note, write_reports)
from experiments.harness.search import search_systems
from experiments.harness.trial import describe_trial, run_trial

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
