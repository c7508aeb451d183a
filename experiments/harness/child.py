"""Trials in child processes (each with its own cap, read when TensorFlow starts) and
the search's progress bar on stderr."""

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

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


# A step whose process tree sits this idle for this long is waiting for device memory:
# TensorFlow's BFC allocator retries a failing allocation for up to 10 s, waking when
# memory is freed, before it raises ResourceExhaustedError.  Plain TensorFlow's
# DeepSpeech at 40 frames under 21 MiB reported its OOM after 130 s, 3.4 s of them on the
# CPU, and a time limit would have named time, not memory, as its limit.
IDLE_SECONDS = 30.0
IDLE_CPU_SHARE = 0.02  # of one core
POLL_SECONDS = 2.0


def _cpu_seconds(process):
    """CPU seconds the trial's process and its children (a kernel runner) have used."""
    total = 0.0
    try:
        for member in [process] + process.children(recursive=True):
            times = member.cpu_times()
            total += times.user + times.system
    except psutil.Error:  # a child exited meanwhile: the window starts again
        return None
    return total


class _IdleWatch:
    """Whether a process tree has used at most IDLE_CPU_SHARE of a core over the last
    IDLE_SECONDS (`idle_for`: the seconds it has, else None)."""

    def __init__(self, pid):
        self._process = psutil.Process(pid)
        self._samples = collections.deque()

    def idle_for(self):
        now, cpu = time.perf_counter(), _cpu_seconds(self._process)
        if cpu is None:
            self._samples.clear()
            return None
        self._samples.append((now, cpu))
        while len(self._samples) > 1 and now - self._samples[1][0] >= IDLE_SECONDS:
            self._samples.popleft()
        then, cpu_then = self._samples[0]
        if now - then >= IDLE_SECONDS and cpu - cpu_then <= IDLE_CPU_SHARE * (now - then):
            return now - then
        return None


def _wait(proc, timeout):
    """(stdout, stderr, killed, idle): `killed` at the time limit or, for a process tree
    idle for IDLE_SECONDS, earlier, `idle` then the seconds it was idle (else None)."""
    started = time.perf_counter()
    watch = _IdleWatch(proc.pid)
    while True:
        left = started + timeout - time.perf_counter()
        try:
            stdout, stderr = proc.communicate(timeout=max(min(POLL_SECONDS, left), 0.01))
            return stdout, stderr, False, None
        except subprocess.TimeoutExpired:
            idle = watch.idle_for()
            if idle is None and time.perf_counter() - started < timeout:
                continue
        os.killpg(proc.pid, signal.SIGKILL)  # the trial's own process group
        stdout, stderr = proc.communicate()
        return stdout, stderr, True, idle


def spawn_trial(experiment, args, system, size, timeout):
    """Run one trial in a fresh process (the cap is set there before TensorFlow starts).

    Returns the trial's dict; a process that times out, crashes or prints no
    result gets status timeout, crash or error, and one that sat idle in a step for
    IDLE_SECONDS status memory-wait (TensorFlow's allocator was waiting for memory).
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
    stdout, stderr, killed, idle = _wait(proc, timeout)
    elapsed = time.perf_counter() - started
    phase, at = _last_phase(stderr)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if lines:
        result = json.loads(lines[-1])
        result.update(command=cmd, process_seconds=elapsed, unit=experiment.unit)
        if killed:
            # The trial finished and printed its result within the limit; only the
            # process's exit (TensorFlow's teardown, seconds on a loaded machine) ran over.
            result.update(killed_after_result=True)
        return result
    if idle is not None and (phase or "").startswith("step"):
        return dict(base, status="memory-wait", seconds=elapsed, failed_in=phase,
                    error=f"the CPU idle for {idle:.0f} s in {phase} (begun at {at:.0f} s): "
                    "TensorFlow's allocator was waiting for device memory")
    if killed:
        return dict(base, status="timeout", seconds=elapsed,
                    failed_in=phase, error=f"no result within {elapsed:.0f} s"
                    + (f" (still in {phase}, begun at {at:.0f} s)" if phase else "")
                    + (f", the CPU idle for the last {idle:.0f} s" if idle is not None else ""))
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
