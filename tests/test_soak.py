"""A short soak (tools/soak.py, 200 steps under an emulated cap) and its verdict.

The full 2000-step soak takes minutes and is run by hand (README, Results);
here a small model trains for 200 steps and TensorFlow's own allocator figure
between steps must not move at all, nor the host buffer pool.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import soak  # noqa: E402  pylint: disable=wrong-import-position

MIB = 1 << 20
CAP_MIB = 8


def test_short_soak_does_not_grow(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "soak.py"), "--steps", "200",
         "--warmup", "40", "--every", "20", "--layers", "4", "--batch", "256",
         "--partition-size", "6", "--swap", "all", "--cap", str(CAP_MIB),
         "--rss-tolerance", "50", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    samples = result["samples"]
    assert len(samples) == 9 and result["cap_mib"] == CAP_MIB
    assert result["swapped"] > 0 and result["partitions"] > 10  # partitions and swaps happen
    device = [s["device"] for s in samples]
    assert device[0] > 0 and device == [device[0]] * len(device), (
        f"TensorFlow's allocator between steps: {device}")
    assert len({s["host_buffers"] for s in samples}) == 1
    assert 0 < result["max_device_peak"] <= CAP_MIB * MIB
    assert result["finite"] and result["last_loss"] < result["first_loss"]
    # RSS over 160 steps is noisy; a leak of a swapped tensor per step (2.5 MiB) is not
    assert samples[-1]["rss"] - samples[0]["rss"] < 8 * MIB
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "VERDICT no growth" in proc.stdout


def _result(device, rss, buffers=1000):
    samples = [dict(step=100 + 50 * i, device=d, rss=r, host_buffers=buffers)
               for i, (d, r) in enumerate(zip(device, rss))]
    return dict(samples=samples, seconds=10.0, cap_mib=10, plain_peak=None, partitions=5,
                partition_size=3, swapped=2, swapped_out_bytes=MIB, max_device_peak=5 * MIB,
                first_loss=1.0, last_loss=0.5, finite=True)


@pytest.mark.parametrize("device, rss, ok", [
    ([100] * 5, [500 * MIB] * 5, True),
    ([100, 100, 100, 100, 164], [500 * MIB] * 5, False),  # TF holds more after a step
    ([100] * 5, [500 * MIB + i * MIB for i in range(5)], False),  # 20 MiB per 1000 steps
    ([100] * 5, [500 * MIB + i * 4096 for i in range(5)], True),  # within the tolerance
])
def test_verdict_flags_growth(device, rss, ok):
    got, lines, growth = soak.verdict(_result(device, rss), rss_tolerance_mib=2.0)
    assert got is ok
    assert lines[-1] == "VERDICT " + ("no growth" if ok else "GROWTH or failure (see above)")
    assert growth["device"] >= 0


@pytest.mark.parametrize("argv", [["--cap", "0"], ["--partition-size", "x"], ["--swap", "some"],
                                  ["--steps", "100", "--warmup", "100"], ["--every", "-1"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        soak.parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
