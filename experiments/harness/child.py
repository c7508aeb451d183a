"""Trials in child processes (each with its own cap, read when TensorFlow starts) and
the search's progress bar on stderr."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tfmem.cli import child_env

from experiments.harness.experiment import is_tfmem
from experiments.harness.options import trial_options
from experiments.harness.trial import PHASE

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
