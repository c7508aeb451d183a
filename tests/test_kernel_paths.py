"""Both kernel paths: a real TF1 program, and the equivalence and property tests.

TensorFlow rewrites a graph differently with oneDNN on (TF_ENABLE_ONEDNN_OPTS=1,
its default on CPUs with AVX-512) and off: it merges kernels, changes layouts.
The kernel path is read when TensorFlow starts, so each path runs in processes
of its own:

* tests/programs/cifar10_tf1.py, a CIFAR-10 tutorial-style program (biased
  convolutions, local response normalisation, dozens of summaries merged and
  fetched each step, moving averages applied under control dependencies,
  variables pinned to /cpu:0, fed input), trains plainly and through
  `TFMemSession` at partition sizes 3, 7, 20 and 50 (those whose plans
  tests/test_merged_kernels.py checks) in one process per path; every loss
  and summary value must agree with the plain run's;
* tests/test_equivalence.py and tests/test_random_graphs.py run again in one
  pytest process on the path this process does not run (conftest sets oneDNN
  off unless TF_ENABLE_ONEDNN_OPTS says otherwise).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tfmem.cli import child_env

HERE = os.path.dirname(__file__)
PROGRAM = os.path.join(HERE, "programs", "cifar10_tf1.py")
PATHS = ("0", "1")  # TF_ENABLE_ONEDNN_OPTS
SIZES = (3, 7, 20, 50)  # partition sizes the program trains at, beside its plain run
TIMEOUT = 600


def _env(path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env[child_env.ONEDNN] = path
    return env


@pytest.fixture(scope="module")
def program_runs():
    """{kernel path: the finished process}, both paths run at once."""
    sizes = ",".join(str(s) for s in (0,) + SIZES)
    procs = {path: subprocess.Popen([sys.executable, PROGRAM, "--partition-sizes", sizes],
                                    env=_env(path), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for path in PATHS}
    out = {}
    for path, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
        out[path] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def _runs(stdout):
    """{partition size: (losses, [summary values by tag per step])}."""
    runs, current = {}, None
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word == "run":
            current = runs.setdefault(int(rest.split()[0]), ([], []))
        elif word == "loss":
            current[0].append(float(rest.split()[1]))
        elif word == "summary":
            current[1].append(json.loads(rest.split(" ", 1)[1]))
    return runs


@pytest.mark.parametrize("path", PATHS, ids=lambda path: f"onednn{path}")
@pytest.mark.slow
def test_real_program_trains_as_plain_on_both_kernel_paths(program_runs, path):
    done = program_runs[path]
    assert done.returncode == 0, (f"{child_env.ONEDNN}={path}: the program failed\n"
                                  f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    runs = _runs(done.stdout)
    plain_losses, plain_summaries = runs[0]
    assert len(plain_losses) == 3 and np.all(np.isfinite(plain_losses))
    assert len(plain_summaries[0]) > 30  # every activation, variable and gradient
    for size in SIZES:
        losses, summaries = runs[size]
        np.testing.assert_allclose(losses, plain_losses, rtol=1e-5, err_msg=f"size {size}")
        for step, (got, expected) in enumerate(zip(summaries, plain_summaries)):
            assert sorted(got) == sorted(expected)
            for tag, values in expected.items():
                np.testing.assert_allclose(got[tag], values, rtol=1e-4, atol=1e-6,
                                           err_msg=f"size {size}, step {step}, {tag}")


@pytest.mark.slow
def test_equivalence_and_properties_on_the_other_kernel_path():
    other = "0" if child_env.onednn_from_env() else "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         os.path.join(HERE, "test_equivalence.py"), os.path.join(HERE, "test_random_graphs.py")],
        env=_env(other), capture_output=True, text=True, timeout=TIMEOUT, check=False, cwd=os.path.dirname(HERE))
    assert done.returncode == 0, \
        f"with {child_env.ONEDNN}={other}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout and "failed" not in done.stdout
