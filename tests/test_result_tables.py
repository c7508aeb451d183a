"""The result tables of README.md and docs/results.md are generated from
experiments/results/, and every result file records what produced it."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_readme_result_tables_match_the_result_files():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "results_tables.py"), "--check"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resnet-quick" in proc.stdout
    assert "README.md: 1 generated block(s): headline" in proc.stdout  # the headline table
    assert "docs/results.md" in proc.stdout  # every experiment's own table
    assert "tf2_speed" in proc.stdout  # tools/bench_tf2.py's step-time table
    assert "accuracy" in proc.stdout  # experiments/accuracy.py's simulator accuracy


def test_every_result_file_records_what_produced_it():
    for path in sorted((ROOT / "experiments" / "results").glob("*.json")):
        origin = json.loads(path.read_text()).get("provenance")
        assert origin, f"{path.name} records no provenance"
        for key in ("commit", "tensorflow", "kernel_path", "cpu_count", "date"):
            assert origin.get(key), f"{path.name}: no {key}"
