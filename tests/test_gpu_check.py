"""tools/gpu_check.py on a machine without a GPU: a clear message, exit 2, nothing run."""

import os
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"


def test_without_a_gpu_it_says_so_and_runs_nothing():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_ENABLE_ONEDNN_OPTS="0",
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU visible to TensorFlow" in proc.stderr
    assert "Nothing was run" in proc.stderr
    assert "plain Session" not in proc.stdout  # no worker started
