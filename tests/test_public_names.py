"""Every public name of `tfmem` resolves, in a fresh process: a name whose module moved
(into another wing or folder) must fail here, not only in the one test that happens to use it,
and not pass because another test imported the module first."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = """
import tfmem
missing = []
for name in tfmem.__all__ + ["models", "proof", "serialize"]:
    try:
        getattr(tfmem, name)
    except Exception as err:  # the name and why, for the assertion below
        missing.append(f"{name}: {type(err).__name__}: {err}")
print("\\n".join(missing))
"""


def test_every_public_name_resolves_in_a_fresh_process():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True,
                          cwd=ROOT, timeout=300,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0",
                                   TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", done.stdout
