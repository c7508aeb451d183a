"""`tfmem demo --device-memory`: when the plain session runs out of memory under
the cap, tfmem's losses are still compared, with a plain session trained
without a cap in a fresh process; the demo never passes without a comparison.
"""

import os
import subprocess
import sys

import pytest

# Batch 4096 through partitions of 4 ops: plain TensorFlow needs about 9.5 MiB
# for this step (and the tfmem session's variables share the process), tfmem
# about 7 MiB.
CAPPED = ["--no-proof", "--device-memory", "8", "--steps", "3", "--batch-size", "4096",
          "--partition-size", "4"]


@pytest.mark.slow
def test_capped_demo_compares_losses_when_plain_runs_out_at_step_0():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    proc = subprocess.run([sys.executable, "-m", "tfmem", "demo"] + CAPPED, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    out = proc.stdout
    assert "plain ResourceExhaustedError at step 0" in out, out + proc.stderr[-2000:]
    assert "comparing TFMemSession's 3 losses with a plain Session trained without a cap" in out
    assert "losses match (rtol 0.0001) (plain: uncapped reference process)" in out, out
    assert proc.returncode == 0, out


def test_demo_changes_no_op_tensorflow_ran():
    """TensorFlow warns (at its WARNING log level) when an op it ran is changed; the demo
    runs the same graph plainly and through tfmem, so any change of a user op shows (on
    this process's kernel path, which conftest sets)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0")
    proc = subprocess.run([sys.executable, "-m", "tfmem", "demo", "--no-proof", "--steps", "2"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "losses match" in proc.stdout
    assert "after it was run by a session" not in proc.stderr, proc.stderr[-3000:]
