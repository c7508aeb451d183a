"""The memory proof: under a cap of half plain TensorFlow's measured peak,
a plain Session runs out of memory and a TFMemSession trains with the same
losses.

Each run is a fresh process (`python -m tfmem.proof`), because the cap is
read when TensorFlow starts; this test process has imported TensorFlow
already, which `emulate_accelerator` must refuse.
"""

import os

import numpy as np
import pytest

import tfmem
from tfmem import proof

RTOL = 1e-4
ATOL = 1e-6
MIB = 1 << 20


@pytest.fixture(scope="module")
def result():
    return proof.run_proof()


def _describe(run):
    if run is None:
        return "not run"
    if run["failed"]:
        return f"process failed (exit {run['returncode']}):\n{run['stderr_tail']}"
    return (f"losses {run['losses']}, peak {run['peak_bytes']} B, oom {run['oom']}, "
            f"error {run['error']}")


def test_uncapped_plain_run_trains(result):
    plain = result["plain"]
    assert not plain["failed"], _describe(plain)
    assert not plain["oom"], _describe(plain)
    assert plain["device_memory_mib"] is None
    assert len(plain["losses"]) == proof.DEFAULTS["steps"]
    assert all(np.isfinite(plain["losses"]))
    assert plain["peak_bytes"] > 0


def test_cap_is_half_the_measured_plain_peak(result):
    assert result["cap_mib"] == result["plain"]["peak_bytes"] // 2 // MIB
    assert result["cap_mib"] >= 1
    for key in ("plain_capped", "tfmem_capped"):
        run = result[key]
        assert not run["failed"], f"{key}: {_describe(run)}"
        assert run["device_memory_mib"] == result["cap_mib"], key


def test_plain_session_runs_out_of_memory_under_the_cap(result):
    run = result["plain_capped"]
    assert not run["failed"], _describe(run)
    assert run["oom"], _describe(run)
    assert run["error"].startswith("ResourceExhaustedError"), run["error"]
    assert len(run["losses"]) < proof.DEFAULTS["steps"]
    assert result["plain_oom"]


def test_tfmem_trains_under_the_cap_with_the_plain_losses(result):
    run = result["tfmem_capped"]
    assert not run["failed"], _describe(run)
    assert not run["oom"], _describe(run)
    expected = result["plain"]["losses"]
    assert len(run["losses"]) == len(expected) == proof.DEFAULTS["steps"]
    np.testing.assert_allclose(run["losses"], expected, rtol=RTOL, atol=ATOL)
    assert result["losses_match"]


def test_tfmem_peak_is_within_the_cap(result):
    run = result["tfmem_capped"]
    assert not run["failed"], _describe(run)
    assert 0 < run["peak_bytes"] <= result["cap_mib"] * MIB, (
        f"tfmem peak {run['peak_bytes'] / MIB:.2f} MiB, cap {result['cap_mib']} MiB")
    assert result["tfmem_fits"]
    assert result["ok"]


def test_emulate_accelerator_refuses_after_tensorflow_is_imported():
    import tensorflow  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    from tfmem import accelerator  # pylint: disable=import-outside-toplevel

    before = dict(os.environ)
    size = (accelerator.emulated_memory_mib() or 0) + 1  # not the cap already configured
    with pytest.raises(RuntimeError, match="before TensorFlow is imported"):
        tfmem.emulate_accelerator(size)
    assert dict(os.environ) == before


@pytest.mark.parametrize("size", [0, -1, 2.5])
def test_emulate_accelerator_rejects_sizes_that_are_not_positive_ints(size):
    with pytest.raises(ValueError):
        tfmem.emulate_accelerator(size)
