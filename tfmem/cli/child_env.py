"""The environment of a measuring child process: its allocator and its kernel path.

Two settings decide what TensorFlow's CPU allocator reports, and both are
read once, when TensorFlow starts, so every figure tfmem's tools compare is
measured in a fresh process started with an environment from `child_env`:

* **the allocator.** Without oneDNN (the default on CPUs without AVX-512),
  TensorFlow's default CPU allocator keeps no statistics, so a plain run
  would report a peak of 0.  A baseline therefore runs under the same BFC
  allocator as a capped run (``TF_CPU_ALLOCATOR_USE_BFC=true``), with a
  limit far above any step (`MEASURE_LIMIT_MIB`): same allocator, no cap.
* **the kernel path.** ``TF_ENABLE_ONEDNN_OPTS`` picks oneDNN or TensorFlow's
  own kernels, whose scratch memory differs (convolution gradients by tens
  of MiB).  The machine's default depends on its CPU, so it is always set
  explicitly, never inherited by accident.  With oneDNN, TensorFlow 2.21 has
  crashed (SIGSEGV) instead of raising ``ResourceExhaustedError`` when a
  capped allocator was full, so capped plain baselines run without it.
"""

import json
import os
import signal
import subprocess

from tfmem.memory.emulated import LIMIT_MB, USE_BFC
ONEDNN = "TF_ENABLE_ONEDNN_OPTS"

# A BFC allocator grows on demand, so a 64 GiB limit reserves nothing; it only
# makes the allocator keep figures without ever refusing a step.
MEASURE_LIMIT_MIB = 1 << 16


def onednn_from_env(environ=None, default=False):
    """True / False from TF_ENABLE_ONEDNN_OPTS in `environ` (os.environ); `default` if unset."""
    value = (os.environ if environ is None else environ).get(ONEDNN)
    if value is None or value.strip() == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def kernel_path(onednn):
    """How the kernel path is written in reports."""
    return "oneDNN on" if onednn else "oneDNN off"


def child_env(cap_mib=None, onednn=False, base=None):
    """A copy of `base` (os.environ) for a child that measures memory.

    cap_mib: the emulated accelerator's size in MiB, or None for a baseline
    (the same BFC allocator, limited at MEASURE_LIMIT_MIB).  onednn: the
    kernel path, always written to TF_ENABLE_ONEDNN_OPTS.
    """
    env = dict(os.environ if base is None else base)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[USE_BFC] = "true"
    env[LIMIT_MB] = str(MEASURE_LIMIT_MIB if cap_mib is None else int(cap_mib))
    env[ONEDNN] = "1" if onednn else "0"
    return env


def describe_exit(returncode):
    """'killed by SIGSEGV' for a child a signal ended, else 'exit N'."""
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def self_capping_env(onednn):
    """A copy of os.environ for a child that sets its own cap (`emulate_accelerator`):
    no inherited allocator settings, the kernel path written explicitly."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env[ONEDNN] = "1" if onednn else "0"
    for name in (USE_BFC, LIMIT_MB):
        env.pop(name, None)
    return env


def run_json_child(cmd, env, timeout):
    """Run a child that prints its result as its last JSON line on stdout.

    Returns (result dict or None, the finished process, the last 15 lines of its
    stderr): None when it exited non-zero or printed no JSON line."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                          check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    if proc.returncode != 0 or not lines:
        return None, proc, tail
    return json.loads(lines[-1]), proc, tail
