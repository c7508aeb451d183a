"""Re-plans that reuse: a new plan of a request compiles only the partitions that changed.

Budget mode plans a request again for each new fed shape (and when it learns).
The compiled plan's partitions that still fit are kept and only those over the
budget split (memory/refine.py); the compiler then takes the copies and
callables of every partition equal to one compiled already
(run/compiling/reuse.py), and `tfmem.function` its partition functions.

The model: an MLP whose first layer reads 4096 features and whose others are
256 wide, so that a larger batch puts the partitions around the first layer
over the budget and leaves the rest alone.  A budget below the CPU's memory is
a ceiling on the prediction: no capped process is needed (`tfmem.function` runs
in a process of its own, where the allocator keeps figures only its tensors
count beside it).  Every step must train exactly as plain TensorFlow does (no
step runs twice, none is left out).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.cli import models
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan
from tfmem.plan.swap import SwapPolicy
from tfmem.run.compiling import reuse
from tfmem.run.placement import accelerator

tf1 = tf.compat.v1
PINNED = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
MIB = 1 << 20
BUDGET_MIB = 40
FUNCTION_BUDGET_MIB = 20  # its step holds no optimizer slots


def _beside_what_is_held(mib):
    """A budget of `mib` MiB beside what the process's CPU allocator holds now (where it
    keeps figures, as with oneDNN on: earlier tests' tensors count as others' there)."""
    memory = accelerator.device_memory("CPU:0")
    return mib * MIB + (memory["current"] if memory else 0)


# the first shape's plan; one a new search plans (its refinement would split most
# partitions); one whose refinement of the plan before keeps most of them
BATCHES = (512, 640, 768)


def _model():
    return models.mlp(layers=24, width=256, features=4096)


def _weights(sess, graph):
    return sess.run(graph.get_collection("trainable_variables"))


@pytest.fixture(scope="module")
def session_runs():
    """(plain losses and weights, tfmem's, and each step's CompileStats or None)."""
    plain_model, tfmem_model = _model(), _model()
    with tf1.Session(graph=plain_model.graph, config=PINNED) as plain:
        plain.run(plain_model.init)
        plain_losses = [plain.run([plain_model.train, plain_model.loss],
                                  plain_model.feed(b))[1] for b in BATCHES]
        plain_weights = _weights(plain, plain_model.graph)
    sess = tf1.Session(graph=tfmem_model.graph, config=PINNED)
    tfs = tfmem.TFMemSession(sess, device_memory_budget=_beside_what_is_held(BUDGET_MIB))
    tfs.run(tfmem_model.init)
    losses, compiles, partitions = [], [], []
    for batch in BATCHES:
        before = tfs.last_compile
        losses.append(tfs.run([tfmem_model.train, tfmem_model.loss],
                              tfmem_model.feed(batch))[1])
        compiles.append(tfs.last_compile if tfs.last_compile is not before else None)
        partitions.append(tfs.last_step.partitions)
    weights = _weights(sess, tfmem_model.graph)
    tfs.close()
    return dict(plain_losses=plain_losses, plain_weights=plain_weights, losses=losses,
                weights=weights, compiles=compiles, partitions=partitions)


@pytest.mark.slow
def test_a_replan_of_a_session_compiles_only_the_partitions_that_changed(session_runs):
    first, _, refined = session_runs["compiles"]
    assert first.reused_calls == 0 and first.made_callables == first.callables
    assert session_runs["partitions"][2] > session_runs["partitions"][1] > 1
    assert refined is not None and not refined.reused, session_runs["compiles"]
    assert refined.reused_calls > 0, refined
    assert refined.made_callables == refined.callables - refined.reused_calls \
        - refined.run_by_name
    assert refined.made_callables < refined.callables - refined.run_by_name


@pytest.mark.slow
def test_steps_of_reused_partitions_train_like_plain(session_runs):
    assert np.array_equal(session_runs["losses"], session_runs["plain_losses"])
    for ours, plain in zip(session_runs["weights"], session_runs["plain_weights"]):
        assert np.array_equal(ours, plain)


# growing a little at a time: the kernel paths' plans differ, and a step of each path
# must outgrow its plan by a few partitions only
FUNCTION_BATCHES = (512, 576, 640, 704, 768)
FUNCTION_SCRIPT = r"""
import gc, json, logging, sys
import numpy as np
import tensorflow as tf
import tfmem
from tfmem.run.placement import accelerator
BATCHES, BUDGET_MIB = json.loads(sys.argv[1]), int(sys.argv[2])
compiles = []
handler = logging.Handler()
handler.emit = lambda r: compiles.append(list(r.args[-2:])) \
    if "partition functions made" in r.getMessage() else None
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)


def variables():
    rng = np.random.default_rng(0)
    shapes = [(4096, 256)] + [(256, 256)] * 23
    return [tf.Variable(rng.standard_normal(s).astype(np.float32) * 0.05) for s in shapes]


def train_step(weights):
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.nn.relu(h @ w)
            loss = tf.reduce_mean(h * h)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.01 * g)
        return loss
    return step


signature = [tf.TensorSpec([None, 4096], tf.float32)]
inputs = [np.random.default_rng(b).standard_normal((b, 4096)).astype(np.float32)
          for b in BATCHES]
plain_vars = variables()
plain = tf.function(train_step(plain_vars), input_signature=signature)
plain_losses = [float(plain(tf.constant(x))) for x in inputs]
plain_weights = [v.numpy() for v in plain_vars]
del plain, plain_vars
gc.collect()
our_vars = variables()
# where the allocator keeps figures (oneDNN on), the function's captured variables and
# the batch it is fed are what the device holds beside it: the budget is beside them
memory = accelerator.device_memory("CPU:0")
held = memory["current"] + max(x.nbytes for x in inputs) if memory else 0
ours = tfmem.function(train_step(our_vars), input_signature=signature,
                      device_memory_budget=BUDGET_MIB * (1 << 20) + held)
steps = []
for x in inputs:
    compiles.clear()
    steps.append({"loss": float(ours(tf.constant(x))), "compiles": list(compiles)})
print(json.dumps({"plain_losses": plain_losses, "steps": steps, "same_weights": all(
    np.array_equal(a.numpy(), b) for a, b in zip(our_vars, plain_weights))}))
"""


@pytest.mark.slow
def test_a_replan_of_a_function_compiles_only_the_partitions_that_changed():
    """In a process of its own: where the allocator keeps figures, everything a process
    holds is beside the function."""
    done = subprocess.run([sys.executable, "-c", FUNCTION_SCRIPT, json.dumps(FUNCTION_BATCHES),
                           str(FUNCTION_BUDGET_MIB)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-4000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert [step["loss"] for step in run["steps"]] == run["plain_losses"]
    assert run["same_weights"]
    (first_made, first_taken), = run["steps"][0]["compiles"]
    assert first_made > 1 and first_taken == 0
    later = [compiled for step in run["steps"][1:] for compiled in step["compiles"]]
    assert any(taken > 0 for _, taken in later), run["steps"]


def test_interchangeable_partitions_agree_on_every_crossing():
    """Two plans' partitions share a key only where they do the same; a kept output
    swapped in another plan, or an input deleted in one and not the other, differ."""
    model = _model()
    view = analyse([model.loss], [model.train], list(model.feed(8)))
    kept = make_plan(view, 40, SwapPolicy("none"))
    swapped = make_plan(view, 40, SwapPolicy("all"))
    again = make_plan(view, 40, SwapPolicy("none"))
    keys = [reuse.partition_key(kept, p) for p in kept.partitions]
    assert keys == [reuse.partition_key(again, p) for p in again.partitions]
    assert reuse.reusable(again, [_Compiled(kept)]) == dict(enumerate(range(len(keys))))
    crossing = [p.index for p in kept.partitions if p.outputs]
    found = reuse.reusable(swapped, [_Compiled(kept)])
    assert crossing and not set(crossing) & set(found)


class _Compiled(reuse.Compiled):
    """A plan's keys, with each partition's index standing for its program."""

    def __init__(self, plan):
        super().__init__(plan, tuple(range(len(plan.partitions))))
