"""The memory proof, on both kernel paths: under a cap of half plain
TensorFlow's measured peak, a plain Session runs out of memory and a
TFMemSession trains with the same losses; without a cap, TFMemSession's
measured peak stays under half of plain TensorFlow's.

The whole proof runs twice, in one `python -m tfmem.cli.proof --json` process per
kernel path (TF_ENABLE_ONEDNN_OPTS=0 and =1), each starting a fresh process
per run, because the allocator, its cap and the kernel path are read when
TensorFlow starts.  So CI on a machine whose default is either path covers
both.  Both proofs run at once, each in its own processes.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tfmem
from tfmem.cli import child_env, proof

# every test reads the memory proof's four processes per kernel path
pytestmark = pytest.mark.slow

RTOL = 1e-4
ATOL = 1e-6
MIB = 1 << 20
PATHS = ("0", "1")  # TF_ENABLE_ONEDNN_OPTS


@pytest.fixture(scope="module")
def results():
    """{kernel path: run_proof result}, both proofs run concurrently."""
    procs = {}
    for path in PATHS:
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env[child_env.ONEDNN] = path
        procs[path] = subprocess.Popen([sys.executable, "-m", "tfmem.cli.proof", "--json"], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for path, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, f"proof with {child_env.ONEDNN}={path} printed no result:\n{stderr[-3000:]}"
        out[path] = (json.loads(lines[-1]), proc.returncode)
    return out


@pytest.fixture(params=PATHS, ids=lambda path: f"onednn{path}")
def result(request, results):
    return results[request.param][0] | {"path": request.param,
                                        "returncode": results[request.param][1]}


def _describe(run):
    if run is None:
        return "not run"
    if run["failed"]:
        return f"process failed ({run['how']}):\n{run['stderr_tail']}"
    return (f"losses {run['losses']}, peak {run['peak_bytes']} B, oom {run['oom']}, "
            f"error {run['error']}")


def test_every_run_has_its_kernel_path_set_explicitly(result):
    assert result["onednn"] is (result["path"] == "1")
    for key in ("plain", "tfmem_capped", "tfmem_uncapped"):
        assert result[key]["onednn"] == result["path"], key
    # The capped plain baseline runs without oneDNN, whose kernels crashed at a full cap.
    assert result["plain_capped"]["onednn"] == "0"


def test_uncapped_plain_run_trains_and_measures_its_peak(result):
    plain = result["plain"]
    assert not plain["failed"], _describe(plain)
    assert not plain["oom"], _describe(plain)
    # No cap, but the same BFC allocator as the capped runs: it keeps figures on every path.
    assert plain["device_memory_mib"] is None
    assert plain["allocator_limit_mib"] == child_env.MEASURE_LIMIT_MIB
    assert len(plain["losses"]) == proof.DEFAULTS["steps"]
    assert all(np.isfinite(plain["losses"]))
    # 24 layers keep at least one [1024, 256] float activation each for the backward pass.
    layers, batch, width = (proof.DEFAULTS[k] for k in ("layers", "batch", "width"))
    assert plain["peak_bytes"] > layers * batch * width * 4


def test_cap_is_half_the_measured_plain_peak(result):
    assert result["cap_mib"] == result["plain"]["peak_bytes"] // 2 // MIB
    assert result["cap_mib"] >= 1
    for key in ("plain_capped", "tfmem_capped"):
        run = result[key]
        assert not run["failed"], f"{key}: {_describe(run)}"
        assert run["device_memory_mib"] == run["allocator_limit_mib"] == result["cap_mib"], key


def test_plain_session_runs_out_of_memory_under_the_cap(result):
    run = result["plain_capped"]
    assert not run["failed"], _describe(run)
    assert run["oom"], _describe(run)
    assert run["error"].startswith("ResourceExhaustedError"), run["error"]
    assert len(run["losses"]) < proof.DEFAULTS["steps"]
    assert result["plain_oom"] and not result["plain_crashed"]


def test_tfmem_trains_under_the_cap_with_the_plain_losses(result):
    run = result["tfmem_capped"]
    assert not run["failed"], _describe(run)
    assert not run["oom"], _describe(run)
    expected = result["plain"]["losses"]
    assert len(run["losses"]) == len(expected) == proof.DEFAULTS["steps"]
    np.testing.assert_allclose(run["losses"], expected, rtol=RTOL, atol=ATOL)
    assert result["tfmem_fits"] and result["losses_match"]
    assert run["partitions"] > 1 and run["swapped_out_bytes"] > 0


def test_tfmem_peak_without_a_cap_is_under_half_the_plain_peak(result):
    # Under the cap, tfmem's peak is within it by construction; without one it is not.
    run, plain = result["tfmem_uncapped"], result["plain"]
    assert not run["failed"] and not run["oom"], _describe(run)
    assert run["device_memory_mib"] is None
    np.testing.assert_allclose(run["losses"], plain["losses"], rtol=RTOL, atol=ATOL)
    assert 0 < 2 * run["peak_bytes"] < plain["peak_bytes"], (
        f"tfmem {run['peak_bytes'] / MIB:.1f} MiB, plain {plain['peak_bytes'] / MIB:.1f} MiB")
    assert result["tfmem_peak_below_half"]


def test_the_proof_passes_and_its_exit_status_says_so(result):
    assert result["reasons"] == [] and result["ok"]
    assert result["returncode"] == 0


def test_a_crashed_capped_run_is_reported_as_a_crash():
    crashed = dict(system="tf", device_memory_mib=10, onednn="1", failed=True, crashed=True,
                   returncode=-11, how=child_env.describe_exit(-11), stderr_tail="(log)")
    plain = dict(failed=False, oom=False, crashed=False, losses=[1.0], peak_bytes=20 * MIB,
                 step_time_median=0.1)
    result = dict(onednn=True, plain=plain, cap_mib=10, plain_capped=crashed, tfmem_capped=None,
                  tfmem_uncapped=None, max_rel_diff=None, losses_match=False,
                  tfmem_peak_ratio=None, ok=False, reasons=["the capped plain run crashed"])
    lines = []
    proof.report(result, out=lines.append)
    text = "\n".join(lines)
    assert "CRASHED (killed by SIGSEGV)" in text
    assert "ResourceExhaustedError" not in text and "memory proof: FAILED" in text


def test_emulate_accelerator_refuses_after_tensorflow_is_imported():
    import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    before = dict(os.environ)
    size = (accelerator.emulated_memory_mib() or 0) + 1  # not the cap already configured
    with pytest.raises(RuntimeError, match="before TensorFlow is imported"):
        tfmem.emulate_accelerator(size)
    assert dict(os.environ) == before


@pytest.mark.parametrize("size", [0, -1, 2.5])
def test_emulate_accelerator_rejects_sizes_that_are_not_positive_ints(size):
    with pytest.raises(ValueError):
        tfmem.emulate_accelerator(size)
