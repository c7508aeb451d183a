"""The simulator: its predicted device peak against TensorFlow's measured one,
and the properties every trace holds whatever the graph.

Accuracy runs in one fresh process with an emulated accelerator (the cap is
read when TensorFlow starts, and this process has imported TensorFlow
already); the process prints one JSON line with every measurement.  The pure
properties plan and simulate in this process and run no step.
"""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

import tfmem
from tfmem import models
from tfmem.budget import DEFAULT_MARGIN
from tfmem.plan import make_plan
from tfmem.proof import build_model
from tfmem.shapes import resolve_shapes
from tfmem.simulate import simulate
from tfmem.swap import SwapPolicy

tf1 = tf.compat.v1

MIB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.15
# The MLP at large partitions is a known gap (oneDNN scratch memory the
# simulator cannot see; -8..-21% measured at sizes 100000 and 200): only size 20 is held to
# TOLERANCE.
MLP_SANITY = 0.5

# (model, builder kwargs, batch)
MODELS = {
    "resnet": ("resnet", dict(blocks=(2, 2, 2)), 32),
    "rnn": ("unrolled_rnn", {}, 256),
    "mlp": ("mlp", dict(layers=12), 1024),
}
SIZES = (100000, 200, 50, 20)
# One process: two side by side on a 2-core machine delay each other's prefetch
# threads, which lowers the measured peaks (uploads land later) and widens the errors.
GROUPS = (("resnet", "rnn", "mlp"),)
# Steps 2..STEPS are measured (the first warms caches). The same step's peak varies by
# up to ~4 MiB from run to run (BFC chunks, inter-op scheduling, how the prefetcher's
# uploads overlap a partition), so accuracy is judged against the median step and
# safety against the worst one.
STEPS = 5
ACCURATE = [(m, s) for m in ("resnet", "rnn") for s in SIZES] + [("mlp", 20)]

ACCURACY_SCRIPT = r"""
import json, os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(8192)
import tensorflow as tf
from tfmem import models

configs, sizes, steps = (json.loads(a) for a in sys.argv[1:4])
results = []
for key, (builder, kwargs, batch) in configs.items():
    if "blocks" in kwargs:
        kwargs["blocks"] = tuple(kwargs["blocks"])
    for size in sizes:
        model = getattr(models, builder)(**kwargs)
        sess = tf.compat.v1.Session(graph=model.graph)
        tfs = tfmem.TFMemSession(sess, partition_size=size)
        # Not sess.run(init): a plain run caches the initializer's folded constants
        # (3 MiB of zeros for the MLP's momentum slots) in the session for good, and
        # they would count in every step's measured peak.
        tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
        feed = model.feed(batch)
        peaks, waits = [], []
        for _ in range(steps):
            tfs.run([model.train, model.loss], feed)
            peaks.append(tfs.last_step.device_peak_bytes)
            waits.append(tfs.last_step.prefetch_wait_time)
        report = tfs.memory_report()
        results.append(dict(model=key, partition_size=size, peaks=peaks, waits=waits,
                            load=os.getloadavg()[0],
                            measured=sorted(peaks[1:])[(steps - 1) // 2],  # median
                            worst=max(peaks[1:]),
                            predicted=report.predicted_device_peak,
                            report_peak=report.device_peak,
                            partitions=tfs.last_step.partitions))
        tfs.close()
        del tfs, sess, model, feed
print(json.dumps(results))
"""


def _measure(groups):
    """Rows of ACCURACY_SCRIPT, one capped process per group of models, run side by side."""
    processes = [subprocess.Popen(
        [sys.executable, "-c", ACCURACY_SCRIPT, json.dumps({k: MODELS[k] for k in group}),
         json.dumps(SIZES), str(STEPS)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        for group in groups]
    rows = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=600)
            assert process.returncode == 0, f"accuracy process failed:\n{stderr[-4000:]}"
            rows += json.loads(stdout.strip().splitlines()[-1])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return rows


@pytest.fixture(scope="module")
def accuracy():
    """{(model, partition_size): measurement} from capped processes."""
    rows = _measure(GROUPS)
    table = {}
    print(f"\nsimulator accuracy (predicted vs TensorFlow's peak, median of steps 2..{STEPS}):")
    for row in rows:
        row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
        row["worst_error"] = (row["predicted"] - row["worst"]) / row["worst"]
        table[row["model"], row["partition_size"]] = row
        print(f"  {row['model']:>6} partition_size={row['partition_size']:<6} "
              f"partitions={row['partitions']:<3} predicted {row['predicted'] / MIB:6.1f} MiB "
              f"measured {row['measured'] / MIB:6.1f} MiB  error {row['error']:+6.1%} "
              f"(worst step {row['worst_error']:+6.1%})  "
              f"(steps {', '.join(f'{p / MIB:.1f}' for p in row['peaks'])}; "
              f"prefetch wait {max(row['waits'][1:]) * 1e3:.0f} ms; load {row['load']:.1f})")
    return table


def test_accuracy_run_measured_every_configuration(accuracy):
    assert set(accuracy) == {(m, s) for m in MODELS for s in SIZES}
    for (model, size), row in accuracy.items():
        assert all(isinstance(p, int) and p > 0 for p in row["peaks"]), (model, size, row)
        assert row["report_peak"] == row["peaks"][-1], "memory_report is the last step's"
        assert row["predicted"] > 0
        if size == 100000:
            assert row["partitions"] == 1, (model, row)
        else:
            assert row["partitions"] > 1, (model, size, row)


@pytest.mark.parametrize("model,size", [pytest.param(m, s, id=f"{m}-{s}") for m, s in ACCURATE])
def test_predicted_peak_within_tolerance(accuracy, model, size):
    row = accuracy[model, size]
    assert abs(row["error"]) <= TOLERANCE, (
        f"{model} partition_size={size}: predicted {row['predicted'] / MIB:.2f} MiB, "
        f"measured {row['measured'] / MIB:.2f} MiB ({row['error']:+.1%}); steps "
        f"{[round(p / MIB, 2) for p in row['peaks']]} MiB, prefetch waits "
        f"{[round(w * 1e3) for w in row['waits']]} ms, load average {row['load']:.1f}")


def test_budget_margin_covers_the_worst_step(accuracy):
    """Budget mode plans to (1 - margin) of the budget: even the worst step must fit."""
    for (model, size), row in accuracy.items():
        assert row["worst"] * (1 - DEFAULT_MARGIN) <= row["predicted"], (model, size, row)


def test_mlp_large_partitions_known_gap_is_bounded(accuracy):
    """Not held to TOLERANCE (see MLP_SANITY); a gross regression still fails."""
    for size in SIZES:
        row = accuracy["mlp", size]
        assert abs(row["error"]) <= MLP_SANITY, (size, row)


def test_smaller_partitions_predict_and_measure_less(accuracy):
    for model in ("resnet", "rnn"):
        whole, smallest = accuracy[model, SIZES[0]], accuracy[model, SIZES[-1]]
        assert smallest["predicted"] < whole["predicted"], model
        assert smallest["measured"] < whole["measured"], model


# --------------------------------------------------------------------------
# pure properties: plans and traces, no step runs


def _plan(swap, partition_size=4):
    # The proof's MLP: every tensor has a static shape.
    graph, x, loss, train, _ = build_model(tf, layers=6, batch=64, width=128, seed=0)
    return make_plan([loss], [train], [x], partition_size, SwapPolicy(swap, 2, 1, 0))


@pytest.mark.parametrize("swap", ["auto", "all", "none"])
def test_trace_has_a_partition_per_plan_partition_and_peak_above_state(swap):
    plan = _plan(swap)
    trace = simulate(plan)
    assert len(plan.partitions) > 3
    assert len(trace.partitions) == len(plan.partitions)
    assert [p.index for p in trace.partitions] == list(range(len(plan.partitions)))
    variables = 6 * 128 * 128 * 4  # six float32 variables, plus small constants
    assert variables <= trace.state_bytes < variables + 4096
    assert trace.peak_device >= trace.state_bytes
    assert trace.unknown_tensors == 0
    for p in trace.partitions:
        assert p.device_peak >= p.device_before >= trace.state_bytes
        assert p.device_peak >= p.device_after >= trace.state_bytes
    assert trace.peak_device == max(p.device_peak for p in trace.partitions)
    assert trace.peak_partition in range(len(plan.partitions))
    assert str(trace).startswith("predicted device peak")


def test_swap_none_moves_nothing_to_the_host():
    plan = _plan("none")
    assert plan.transfers and not any(t.swapped for t in plan.transfers)
    trace = simulate(plan)
    assert trace.bytes_to_host == 0
    assert trace.bytes_to_device == 0
    assert trace.peak_host == 0
    assert all(p.host_after == 0 for p in trace.partitions)


def test_swap_all_moves_the_swapped_transfer_bytes():
    plan = _plan("all")
    view = plan.view
    swapped = [t for t in plan.transfers if t.swapped]
    assert swapped
    assert all(view.tensor(t.tensor).nbytes is not None for t in plan.transfers)
    to_host = sum(view.tensor(t.tensor).nbytes for t in swapped)
    to_device = sum(view.tensor(t.tensor).nbytes
                    for t in plan.transfers for span in t.spans if span.uploaded)
    trace = simulate(plan)
    assert trace.bytes_to_host == to_host
    assert trace.bytes_to_device == to_device
    assert to_device >= to_host > 0
    assert 0 < trace.peak_host <= to_host
    # Per partition: what it swaps out is what its producers sent to the host.
    for p, memory in zip(plan.partitions, trace.partitions):
        assert memory.to_host == sum(view.tensor(t).nbytes for t in p.outputs
                                     if plan.transfer(t).swapped)
    # Swapping everything needs no more device memory than keeping everything.
    assert trace.peak_device <= simulate(_plan("none")).peak_device


def _mlp_plan(partition_size=10):
    model = models.mlp(layers=4)
    x, = model.inputs
    return model, make_plan([model.loss], [model.train], [x], partition_size)


def test_unknown_dimensions_are_counted_and_resolved_by_feed_shapes():
    model, plan = _mlp_plan()
    x, = model.inputs
    unresolved = simulate(plan)
    assert unresolved.unknown_tensors > 0
    assert simulate(plan, resolve_shapes(model.graph, plan.view, {})) == unresolved

    small = simulate(plan, resolve_shapes(model.graph, plan.view, {x.name: (64, 256)}))
    large = simulate(plan, resolve_shapes(model.graph, plan.view, {x.name: (512, 256)}))
    assert small.unknown_tensors < unresolved.unknown_tensors
    assert large.unknown_tensors == small.unknown_tensors
    assert small.state_bytes == large.state_bytes == unresolved.state_bytes
    assert unresolved.peak_device <= small.peak_device < large.peak_device
    # Activations dominate: eight times the batch, several times the working set.
    assert large.peak_device - large.state_bytes > 4 * (small.peak_device - small.state_bytes)


def test_resolve_shapes_leaves_the_graph_alone():
    model, plan = _mlp_plan()
    x, = model.inputs
    version = model.graph.version
    shapes = resolve_shapes(model.graph, plan.view, {x.name: (64, 256)})
    assert model.graph.version == version
    assert shapes[model.loss.name] == ()
    assert x.shape.as_list() == [None, 256]


def test_session_simulate_is_simulate_of_its_plan():
    model = models.mlp(layers=4)
    x, = model.inputs
    fetches, feed = [model.train, model.loss], model.feed(64)
    with tf1.Session(graph=model.graph) as sess:
        tfs = tfmem.TFMemSession(sess, partition_size=10)
        trace = tfs.simulate(fetches, feed)
        plan = tfs.plan(fetches, feed)
        assert trace == simulate(plan, resolve_shapes(model.graph, plan.view, {x.name: (64, 256)}))
        independent = make_plan([model.loss], [model.train], [x], 10)
        assert trace == simulate(independent, resolve_shapes(model.graph, independent.view,
                                                             {x.name: (64, 256)}))
        # Only data-dependent shapes stay unknown (BroadcastGradientArgs' index vectors).
        assert trace.unknown_tensors < simulate(plan).unknown_tensors
        assert tfs.last_step is None  # nothing ran
        bigger = tfs.simulate(fetches, model.feed(512))
        assert bigger.peak_device > trace.peak_device


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_graphs_have_no_tensor_of_unknown_size(name):
    """Feeds resolve every shape; gradient broadcast axes are bounded by their input shapes."""
    builder, kwargs, batch = MODELS[name]
    model = getattr(models, builder)(**kwargs)
    with tf1.Session(graph=model.graph) as sess:
        trace = tfmem.TFMemSession(sess, partition_size=50).simulate(
            [model.train, model.loss], model.feed(batch))
    assert trace.unknown_tensors == 0
    assert trace.peak_device > trace.state_bytes
