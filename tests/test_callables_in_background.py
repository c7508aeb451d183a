"""A plan's callables without allocation tracking are made beside its steps.

A plan's first steps are measured (allocation tracking on); the steps after them
need callables without tracking, which cost what the first step's did.  Where
those took long, they are made on a thread of their own while the measuring
callables run the steps, and the steps switch to them once made.  Checked in a
fresh process (oneDNN off, set explicitly; a BFC allocator capped far above
the step, so that steps are measured) with every plan treated as slow to make:
the main thread never makes an untracked callable, the steps give plain
TensorFlow's numbers before, during and after the switch, the new callables run
the later steps, and closing the session stops the thread.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import collections, json, os, re, threading
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(512)
import tensorflow as tf
from tfmem import tf_private
from tfmem.cli import models
from tfmem.run.executing import execute

execute.BACKGROUND_AFTER_SECONDS = 0.0  # every plan's callables are slow to make
made, calls = collections.Counter(), collections.Counter()
make_callable = tf_private.make_callable


def recording(session, options):
    raw = make_callable(session, options)
    names = list(options.fetch) + list(options.target)
    if not any(re.match(r"tfmem/plan(_[0-9]+)?/p[0-9]+", name) for name in names):
        return raw  # not a partition's: uploads, releases of kept tensors
    made_by = (threading.current_thread().name, options.run_options.trace_level > 0)
    made[made_by] += 1

    def counted(*args, **kwargs):
        calls[made_by] += 1
        return raw(*args, **kwargs)
    return counted


tf_private.make_callable = recording
model = models.mlp(layers=4)
feed = model.feed(64)
plain = tf.compat.v1.Session(graph=model.graph)
tfs = tfmem.TFMemSession(tf.compat.v1.Session(graph=model.graph), partition_size=6)
plain.run(model.init)
tfs.run(model.init)
losses = []


def step():
    losses.append((tfs.run([model.train, model.loss], feed)[1],
                   plain.run([model.train, model.loss], feed)[1]))


for _ in range(8):
    step()
for thread in threading.enumerate():
    if thread.name == "tfmem-callables":
        thread.join(300)
calls_before = dict(calls)
for _ in range(3):
    step()
tfs.close()
print(json.dumps({
    "equal": all(a == b for a, b in losses),
    "made": {f"{name} {'tracked' if tracked else 'untracked'}": n
             for (name, tracked), n in made.items()},
    "untracked_calls_after": calls[("tfmem-callables", False)]
                             - calls_before.get(("tfmem-callables", False), 0),
    "tracked_calls_before": calls_before.get(("MainThread", True), 0),
    "alive": [t.name for t in threading.enumerate() if t.name == "tfmem-callables"]}))
"""


@pytest.mark.slow
def test_untracked_callables_are_made_beside_the_steps():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          cwd=ROOT, timeout=600,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["equal"], out
    made = out["made"]
    assert made.get("MainThread tracked", 0) > 1, out  # the measured first steps
    assert "MainThread untracked" not in made, out
    assert made.get("tfmem-callables untracked", 0) > 1, out
    assert out["untracked_calls_after"] > 0, out  # the later steps run the new ones
    assert out["alive"] == [], out
