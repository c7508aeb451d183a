"""The Python examples in README.md and docs/*.md run, so what they show stays true.

Every fenced ```python block runs, each in a fresh process on the Eigen kernel
path (TF_ENABLE_ONEDNN_OPTS=0), unless the line before it is `<!-- not run -->`
(signatures and sketches). Each runnable example asserts its own claim (losses
equal to plain TensorFlow's) and must exit 0.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not run -->"
FENCE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.S | re.M)
README_LIMIT = 15 * 1024  # bytes: the README is the front door; the rest lives in docs/


def python_blocks(text):
    """(line number, code, runnable) of every ```python block of a markdown text."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, match.start()) + 1
        blocks.append((line, match.group("code"), before != NOT_RUN))
    return blocks


def runnable_examples():
    return [pytest.param(code, id=f"{path.relative_to(ROOT)}:{line}")
            for path in DOCUMENTS for line, code, runnable in python_blocks(path.read_text())
            if runnable]


def test_blocks_marked_not_run_are_skipped_and_the_others_found():
    text = "a\n\n```python\nprint(1)\n```\n\n<!-- not run -->\n```python\nf(\n```\n```sh\nls\n```\n"
    assert [(code, runnable) for _, code, runnable in python_blocks(text)] == [
        ("print(1)\n", True), ("f(\n", False)]


def test_the_readme_shows_its_three_front_ends_as_runnable_examples():
    readme = [code for _, code, runnable in python_blocks((ROOT / "README.md").read_text())
              if runnable]
    assert any("tfmem.TFMemSession(" in code for code in readme)
    assert any("@tfmem.function(" in code for code in readme)
    assert any("tfmem.keras.partitioned(" in code for code in readme)


def test_the_readme_stays_a_front_door():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; move detail into docs/"


@pytest.mark.parametrize("code", runnable_examples())
@pytest.mark.slow
def test_example_runs(code, tmp_path):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
