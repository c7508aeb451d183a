"""tools/gpu_check.py on a machine without a GPU: a clear message, exit 2, nothing run."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"


@pytest.mark.slow
def test_without_a_gpu_it_says_so_and_runs_nothing():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_ENABLE_ONEDNN_OPTS="0",
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU visible to TensorFlow" in proc.stderr
    assert "Nothing was run" in proc.stderr
    assert "plain Session" not in proc.stdout  # no worker started


@pytest.mark.slow
def test_the_tfmem_worker_reports_placement_buffers_and_overlap(tmp_path):
    """The worker's own checks, with CPU:1 standing in for the GPU (no proof here)."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"):
        env.pop(name, None)
    cmd = [sys.executable, str(TOOL), "--worker", "tfmem", "--cpu-stand-in", "--cap", "256",
           "--layers", "4", "--batch", "2048", "--width", "128", "--steps", "2",
           "--partition-size", "6", "--trace", str(tmp_path / "trace.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["oom"] is None and len(result["losses"]) == 2
    assert result["moved"] == result["variables"] == [f"w{i}" for i in range(4)]
    assert result["devices"]["VarHandleOp"] == ["device:CPU:0"]
    assert result["devices"]["ResourceApplyGradientDescent"] == ["device:CPU:0"]
    assert result["devices"]["MatMul"] == ["device:CPU:1"]
    if not result["pinned_pool"]:  # no CUDA runtime in the process (a CPU-only machine)
        assert result["page_locked"] is False
    assert result["swapped_out_bytes"] > 0
    assert 0 < result["uploads_ms"] and 0 <= result["overlap_ms"] <= result["uploads_ms"]
