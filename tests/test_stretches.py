"""Stretches: consecutive partitions run in one callable, one partition after another.

Results are compared bit for bit with plain Session.run on a second session
with the same config (tfmem's: Grappler off, so both sides run the same
kernels), and memory with the same plan run one callable per partition.
"""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from conftest import tfmem_config
from tfmem.cli import models
from tfmem.plan import stretches
from tfmem.plan.build import validate

tf1 = tf.compat.v1


def _valid(plan):
    """validate() a plan of stretches (which are larger than its partition_size)."""
    validate(dataclasses.replace(plan, partition_size=max(len(p.ops) for p in plan.partitions)))


def _check_boundaries(plan):
    """Within a stretch nothing leaves the device and nothing is uploaded."""
    for group in stretches.stretches(plan):
        for earlier, later in zip(group, group[1:]):
            before, after = plan.partitions[earlier], plan.partitions[later]
            assert not before.fetches, (earlier, before.fetches)
            assert not any(plan.transfer(t).swapped for t in before.outputs), earlier
            assert not after.uploads, later
            assert not any(plan.transfer(t).span_of(later).uploaded for t in after.inputs)


def test_a_plan_that_swaps_nothing_runs_in_two_callables_bit_for_bit(two_sessions):
    """ResNet-14: the forward pass up to the fetched loss, and the rest; every weight and
    loss equals plain Session.run's over three training steps."""
    model = models.resnet(blocks=(2, 2, 2), width=8, image=16)
    plain, wrapped = two_sessions(model.graph)
    plain.run(model.init)
    wrapped.run(model.init)
    tfs = tfmem.TFMemSession(wrapped, partition_size=30, swap="none")
    fetches = [model.train, model.loss]
    for step in range(3):
        feed = model.feed(8, data_seed=step)
        assert plain.run(model.loss, feed) == tfs.run(model.loss, feed)
        expected, got = plain.run(fetches, feed), tfs.run(fetches, feed)
        assert expected[1] == got[1]
    plan = tfs.plan(fetches, feed)
    assert tfs.last_compile.callables == len(stretches.stretches(plan)) == 2
    assert tfs.last_step.partitions == len(plan.partitions) > 10
    _valid(stretches.merged(plan))
    weights = model.graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
    for a, b in zip(plain.run(weights), wrapped.run(weights)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("swap, distance", [("none", 2), ("auto", 1), ("all", 0), ("all", 3)])
def test_stretches_end_where_a_tensor_leaves_or_returns_to_the_device(swap, distance):
    """MLP plans with and without swaps: the stretches respect every swap, upload and
    result, the merged plan is valid, and its transfers are those between stretches."""
    model = models.mlp(layers=8, width=64, features=64)
    session = tf1.Session(graph=model.graph, config=tfmem_config())
    try:
        tfs = tfmem.TFMemSession(session, partition_size=6, swap=swap, swap_distance=distance,
                                 options=tfmem.Options(swap_min_bytes=0))
        plan = tfs.plan([model.train, model.loss], model.feed(16))
    finally:
        session.close()
    groups = stretches.stretches(plan)
    assert [i for g in groups for i in g] == list(range(len(plan.partitions)))
    _check_boundaries(plan)
    merged = stretches.merged(plan)
    _valid(merged)
    stretch_of = {i: s for s, g in enumerate(groups) for i in g}
    crossing = {t.tensor for t in plan.transfers
                if any(stretch_of[c] != stretch_of[t.producer] for c in t.consumers)}
    assert {t.tensor for t in merged.transfers} == crossing
    if swap == "none":
        assert len(groups) < len(plan.partitions) / 3
    if any(t.swapped for t in plan.transfers):
        assert len(groups) > 1


def _read_after_write_graph():
    """A variable updated in an early partition and read later by an op of the user's
    that reads only the variable (an original: it cannot be made to wait).  The plan
    walks the shallower input of the sum first (see partition), so the update comes
    before the read."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [4], name="x")
        v = tf1.get_variable("v", initializer=tf.ones([4]), use_resource=True)
        h = x
        for i in range(2):
            h = tf.tanh(h * 1.5 + 0.25, name=f"early{i}")
        update = tf.raw_ops.AssignAddVariableOp(resource=v.handle, value=h, name="update")
        with tf.control_dependencies([update]):
            updated = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32)
        later = x
        for i in range(10):
            later = tf.sin(later * 0.5, name=f"later{i}")
        read = tf.raw_ops.ReadVariableOp(resource=v.handle, dtype=tf.float32, name="late_read")
        out = tf.add(tf.reduce_sum(later * read), tf.reduce_sum(updated), name="out")
        init = tf1.global_variables_initializer()
    return g, x, update, out, init


def test_an_original_reading_state_the_stretch_wrote_starts_a_new_stretch(two_sessions):
    """The late read runs after the update in one call per partition; in a stretch it
    would run when the call starts and read the variable unwritten, so the stretch ends
    before it, and the step's result equals the per-partition plan's."""
    g, x, update, out, init = _read_after_write_graph()
    feed = {x: np.arange(4, dtype=np.float32)}
    results = {}
    for enabled in (False, True):
        _, wrapped = two_sessions(g)
        wrapped.run(init)
        tfs = tfmem.TFMemSession(wrapped, partition_size=3, swap="none",
                                 options=tfmem.Options(stretches=enabled))
        plan = tfs.plan(out, feed)
        results[enabled] = tfs.run(out, feed)
    reader = next(p.index for p in plan.partitions if "late_read" in p.ops)
    writer = next(p.index for p in plan.partitions if update.name in p.ops)
    assert writer < reader, "the plan must read after the update for this test to mean anything"
    groups = stretches.stretches(plan)
    assert any(reader == g[0] for g in groups), groups
    assert results[True] == results[False]


_MEMORY_CHILD = r"""
import json, sys
import tfmem
tfmem.emulate_accelerator(1024)
import tensorflow as tf
from tfmem.cli import models
tf1 = tf.compat.v1
model = models.resnet(blocks=(2, 2, 2), width=16, image=32)
session = tf1.Session(graph=model.graph, config=tfmem.session_config(
    tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)))
session.run(model.init)
feed = model.feed(32)
out = {}
for name, enabled in (("partitions", False), ("stretches", True), ("partitions2", False),
                      ("stretches2", True)):
    tfs = tfmem.TFMemSession(session, partition_size=30, swap="none",
                             options=tfmem.Options(measure="every", stretches=enabled))
    tfs.run([model.train, model.loss], feed)
    steps, parts = [], []
    for _ in range(3):
        tf.config.experimental.reset_memory_stats("CPU:0")
        base = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tfs.run([model.train, model.loss], feed)
        steps.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - base)
        parts.append([peak - base for peak in tfs.last_step.partition_peak_bytes])
    out[name] = dict(step=min(steps), callables=tfs.last_compile.callables,
                     partitions=[max(p[i] for p in parts) for i in range(len(parts[0]))])
print(json.dumps(out))
"""


@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.slow
def test_a_stretch_holds_what_one_call_per_partition_holds(onednn):
    """Emulated accelerator, both kernel paths: the step peak of a plan run as stretches
    is within 2 % of the same plan run one call per partition (the child resets
    TensorFlow's peak, its own), and every partition's peak is read from the stretch's
    statistics: nine in ten within 10 % or 2 MiB of its own call's.  The two ways
    alternate, two phases each, and the figures compare best to worst: which chunk a
    request gets depends on the process's allocation history, steady within a phase.
    A partition's figure moves between runs of one plan by BFC's chunks (a chunk not
    split counts whole: 0.5, 1 and 1.5 MiB seen); a stage mapping off by one partition
    fails 12-28 of the 40.  Both figures are taken above what the device held before the
    step: the session keeps about a MiB more after its first wrapper's steps, which
    `gc.collect` does not free (CI read every stretch figure 1.6 MiB above the calls'
    when only the first wrapper ran before)."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", _MEMORY_CHILD], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    alone = max(out["partitions"]["step"], out["partitions2"]["step"])
    assert out["stretches"]["callables"] == 2 < out["partitions"]["callables"]
    assert min(out["stretches"]["step"], out["stretches2"]["step"]) <= alone * 1.02, out
    together = list(zip(out["stretches"]["partitions"], out["stretches2"]["partitions"]))
    separate = list(zip(out["partitions"]["partitions"], out["partitions2"]["partitions"]))
    assert len(together) == len(separate)
    close = [any(abs(a - b) <= max(0.1 * b, 2 << 20) for a in ours for b in theirs)
             for ours, theirs in zip(together, separate)]
    assert sum(close) >= 0.9 * len(close), (together, separate)


_OOM_CHILD = r"""
import json, re
import tfmem
tfmem.emulate_accelerator(40)
import tensorflow as tf
from tfmem.cli import models
from tfmem.plan import stretches
tf1 = tf.compat.v1
model = models.mlp(layers=8, width=512, features=512)
session = tf1.Session(graph=model.graph, config=tfmem.session_config(tf1.ConfigProto()))
session.run(model.init)
tfs = tfmem.TFMemSession(session, partition_size=10, swap="none", measure="off")
feed = model.feed(2048)
plan = tfs.plan([model.train, model.loss], feed)
try:
    tfs.run([model.train, model.loss], feed)
    out = dict(error=None)
except tfmem.DeviceMemoryError as err:
    named = re.search(r"\{\{node [^}]*/p\d+/([^}]+)\}\}", str(err.__cause__)).group(1)
    out = dict(error=str(err), partition=err.partition, named=named,
               home=[p.index for p in plan.partitions if named in p.ops],
               stretches=[list(g) for g in stretches.stretches(plan)])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_out_of_memory_inside_a_stretch_names_the_partition_that_ran_out():
    """Emulated 40 MiB: the forward pass's stretch runs out in one of its later partitions;
    DeviceMemoryError names that partition (the op TensorFlow's message names is in it),
    not the stretch's first."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([sys.executable, "-c", _OOM_CHILD], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["error"] is not None, "the step was meant to run out of memory"
    assert out["home"] == [out["partition"]], out
    stretch = next(g for g in out["stretches"] if out["partition"] in g)
    assert out["partition"] != stretch[0], out
    assert f"partition {out['partition']} of " in out["error"]
