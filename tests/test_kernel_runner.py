"""The kernel runner: calibrated scratch does not depend on what the process allocated
before (measured in the user's process, one kernel reads 27, 32 or 48 MiB), and calibration still
works where the runner cannot."""

import json
import logging
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tfmem.cli import child_env
from tfmem.memory import kernel_runner

from conftest import eigen_kernels_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The ResNet experiment's first-stage filter gradient on TensorFlow's own kernels: an
# im2col buffer of about 27 MiB, which a fresh BFC allocator hands out as a 32 MiB
# region and one that once held a 40 MiB tensor splits off a larger free chunk.
CHILD = """
import json, sys
import tensorflow as tf
from tfmem.memory import kernel_runner

if int(sys.argv[1]):
    with tf.Graph().as_default() as earlier, tf.compat.v1.Session() as session:
        session.run(tf.zeros([int(sys.argv[1]) << 18]).op)  # allocated, then freed
graph = tf.Graph()
with graph.as_default():
    images, gradient = tf.zeros([16, 64, 64, 16]), tf.zeros([16, 64, 64, 16])
    op = tf.raw_ops.Conv2DBackpropFilter(input=images, filter_sizes=[3, 3, 16, 16],
                                         out_backprop=gradient, strides=[1, 1, 1, 1],
                                         padding="SAME").op
runner = kernel_runner.run_alone(graph, [op.name], 1)[0][op.name]
here = kernel_runner.measure_here(graph, [op.name], 1)[0][op.name]
print(json.dumps({"runner": runner, "here": here}))
"""


def _figures(earlier_mib):
    env = child_env.child_env(onednn=False)  # the kernels with large scratch
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", CHILD, str(earlier_mib)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_scratch_is_the_same_whatever_the_process_allocated_before():
    fresh, after_a_large_tensor = _figures(0), _figures(40)
    # In the calibrating process itself, the history shows: the same kernel reads two
    # figures (this is what the runner is for; without it both lines below would differ).
    assert fresh["here"] != after_a_large_tensor["here"], (fresh, after_a_large_tensor)
    assert fresh["runner"] == after_a_large_tensor["runner"], (fresh, after_a_large_tensor)
    # The request rounded to 256 bytes: never more than a chunk that held it.
    assert fresh["runner"] % 256 == 0
    assert 16 << 20 < fresh["runner"] <= min(fresh["here"], after_a_large_tensor["here"])


def _small_gradient():
    graph = tf.Graph()
    with graph.as_default():
        op = tf.raw_ops.Conv2DBackpropFilter(
            input=tf.zeros([4, 16, 16, 8]), filter_sizes=[3, 3, 8, 8],
            out_backprop=tf.zeros([4, 16, 16, 8]), strides=[1, 1, 1, 1], padding="SAME").op
    return graph, op.name


@eigen_kernels_only
def test_a_runner_that_dies_leaves_calibration_in_this_process(monkeypatch, caplog):
    graph, name = _small_gradient()
    # A child that reads the request and exits without an answer.
    monkeypatch.setattr(kernel_runner, "_COMMAND",
                        [sys.executable, "-c", "import sys; sys.stdin.readline()"])
    monkeypatch.setattr(kernel_runner, "_RUNNER", None)
    with caplog.at_level(logging.WARNING, logger=kernel_runner.__name__):
        scratch, extra, early = kernel_runner.run_alone(graph, [name], 1)
    assert "the kernel runner failed" in caplog.text
    assert kernel_runner._RUNNER is False  # pylint: disable=protected-access
    here, here_extra, here_early = kernel_runner.measure_here(graph, [name], 1)
    assert set(scratch) == set(here) == {name} and extra == here_extra and early == here_early
    assert scratch[name] > 0
    # Later calibrations go straight to this process, without a warning each time.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=kernel_runner.__name__):
        assert set(kernel_runner.run_alone(graph, [name], 1)[0]) == {name}
    assert not caplog.text


@eigen_kernels_only
def test_a_runner_that_cannot_start_leaves_calibration_in_this_process(monkeypatch, caplog):
    graph, name = _small_gradient()
    monkeypatch.setattr(kernel_runner, "_COMMAND", [os.path.join(ROOT, "no-such-python")])
    monkeypatch.setattr(kernel_runner, "_RUNNER", None)
    with caplog.at_level(logging.WARNING, logger=kernel_runner.__name__):
        scratch = kernel_runner.run_alone(graph, [name], 1)[0]
    assert "could not start the kernel runner" in caplog.text
    assert scratch[name] > 0


@pytest.mark.parametrize("budget_mode", [True, False])
def test_budget_mode_starts_the_runner_when_it_is_set_up(monkeypatch, budget_mode):
    """The child imports TensorFlow while the program builds its model, not in the first
    step: both front ends start it when budget mode is set up, and only then."""
    import tfmem  # pylint: disable=import-outside-toplevel
    monkeypatch.setattr(kernel_runner, "_COMMAND",  # a child that waits for its input
                        [sys.executable, "-c", "import sys; sys.stdin.read()"])
    settings = dict(partition_size="auto", device_memory_budget="64MiB") if budget_mode \
        else dict(partition_size=50)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.placeholder(tf.float32, [4])
    started = []
    for make in (lambda: tfmem.TFMemSession(tf.compat.v1.Session(graph=graph), **settings),
                 lambda: tfmem.function(lambda x: x + 1, **settings)):
        monkeypatch.setattr(kernel_runner, "_RUNNER", None)
        made = make()
        runner = kernel_runner._RUNNER  # pylint: disable=protected-access
        started.append(runner is not None)
        if runner:
            assert runner._child.poll() is None  # pylint: disable=protected-access
            runner.close()
        if isinstance(made, tfmem.TFMemSession):
            made.close()
    assert started == [budget_mode, budget_mode]
