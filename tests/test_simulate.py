"""The simulator: its predicted device peak against TensorFlow's measured one,
and the properties every trace holds whatever the graph.

Accuracy is measured by experiments/accuracy.py (the same measurement renders the
table in docs/results.md): fresh processes, one per kernel path (TF_ENABLE_ONEDNN_OPTS=0
and =1, so a machine of either kind checks both) and allocator layout, each with a BFC
allocator far above the step (read when TensorFlow starts, and this process has
imported TensorFlow already): every model and partition size with regions grown on
demand, and some nets (`ONE_REGION`) with the memory reserved as one region first (a
GPU's layout).  The pure properties plan and simulate in this process and run no step.
"""


import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.cli import models
from tfmem.memory.budget import DEFAULT_MARGIN
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan
from tfmem.cli.proof import build_model
from tfmem.memory.shapes import resolve_shapes
from tfmem.memory.simulate import CandidateShare, TensorSizes, simulate
from tfmem.plan.swap import SwapPolicy

from experiments import accuracy as measurement


tf1 = tf.compat.v1

MIB = 1 << 20
# The measured models, partition sizes, kernel paths and steps (steps 2..STEPS judged).
MODELS, SIZES, STEPS = measurement.MODELS, measurement.SIZES, measurement.STEPS
PATHS = measurement.PATHS
# The accuracy claim: the measured step lies in the band between the two predicted
# figures (requested bytes, BFC chunks), the median step within BAND_TOLERANCE above
# it, the worst within BAND_WORST_TOLERANCE above it: the targets, 10 % and
# 15 %.  The requested figure alone cannot see the chunks large buffers take (the Eigen
# gradients' im2col buffers of 20-27 MiB in chunks of up to 32 MiB put the Eigen ResNet
# 14-25 % above it), so it is judged as the band's lower edge only.  Chained, no
# median and no worst step reads more than 5.2 % above its band (the MoE layer at 200
# on both paths); between runs partitioned plans move by up to 2 MiB (the Eigen MLP
# at 20: 15.25 and 17.25 MiB, a BFC region more or less).
BAND_TOLERANCE = {"eigen": 0.10, "onednn": 0.10}
BAND_WORST_TOLERANCE = {"eigen": 0.15, "onednn": 0.15}
# Those bound a step measured ABOVE the band (under-predicted: the error that makes a
# planned step not fit).  A step measured BELOW it (over-predicted: safe, the plan
# wastes memory) is bounded by BAND_BELOW_TOLERANCE: a judged step can meet chunks the
# earlier steps left (the oneDNN ResNet at 50: median 13.5 % below the band, worst
# step in it).
BAND_BELOW_TOLERANCE = 0.20
# Two configurations' steps move across the band's upper edge between runs of the same
# code, by what the simulator cannot know: where the prefetch thread's uploads fall among
# a partition's allocations (with prefetch 0 every step of a process reads the same
# peak), and the addresses of the allocator's grown regions, by which its best fit
# breaks ties (with prefetch 0 the oneDNN ResNet at 50 still settles at 12.8 to 16.8 MiB
# from process to process).  The oneDNN ResNet at 50 reads 14.8 to 18.8 MiB against
# 14.75 requested and 16.80 in chunks (up to 12 % above the band); the MoE layer at 20
# 8.6 to 11.1 MiB against 8.09 and 9.53 (up to 16 %, on a loaded machine).  Budget mode
# holds a margin for such steps (test_budget_modes_bound_plus_margin_covers_the_worst_step).
BAND_GAPS = {("onednn", "resnet", 50): 0.13}
BAND_GAPS.update({(path, "moe", 20): 0.20 for path in PATHS})


# The models and partition sizes measured with the memory reserved as one region, whole
# and partitioned: nets whose figures there hold only while fed arrays stay out of the
# device's region (request.aligned_feed) and each model's session is freed before the
# next model runs (a hole it leaves in the small first region takes their chunks).
ONE_REGION = ({name: MODELS[name] for name in ("conv", "pool", "rnn")}, (SIZES[0], 50))


@pytest.fixture(scope="module")
def measured():
    """{allocator layout: {(kernel path, model, partition_size): measurement}}, one process
    per kernel path and layout."""
    rows = measurement.run(layouts={"grown": (MODELS, SIZES), "one-region": ONE_REGION})
    print(f"\nsimulator accuracy (predicted vs TensorFlow's peak, median of steps 2..{STEPS}):")
    for row in rows:
        print("  " + measurement.line(row))
    by_layout = {}
    for row in rows:
        by_layout.setdefault(row["layout"], {})[
            row["path"], row["model"], row["partition_size"]] = row
    return by_layout


@pytest.fixture(scope="module")
def accuracy(measured):
    """{(kernel path, model, partition_size): measurement} with regions grown on demand."""
    return measured["grown"]


@pytest.fixture(scope="module")
def one_region(measured):
    """{(kernel path, model, partition_size): measurement} on one region."""
    return measured["one-region"]


@pytest.mark.slow
def test_accuracy_run_measured_every_configuration(accuracy):
    assert set(accuracy) == {(p, m, s) for p in PATHS for m in MODELS for s in SIZES}
    for key, row in accuracy.items():
        assert all(isinstance(p, int) and p > 0 for p in row["peaks"]), (key, row)
        assert row["report_peak"] == row["tfmem_peaks"][-1], "memory_report is the last step's"
        assert row["predicted"] > 0
        assert len(row["partition_peaks"]) == len(row["predicted_partition_peaks"]) \
            == row["partitions"], key
        assert max(row["predicted_partition_peaks"]) == row["predicted"], key
        if key[2] == 100000:
            assert row["partitions"] == 1, (key, row)


# Allocations outside the partitions' traced kernels (feeds, uploads on the prefetch
# thread, first runs of callables): the oneDNN ResNet at size 20 read 18.67 MiB in
# TensorFlow's figure and 16.57 MiB in tfmem's on the step that was the run's peak,
# within the ~2 MiB this open gap of the measurement is documented at (docs/how-it-works.md,
# "What the measurement does not see").
UNTRACED_BYTES = 2 << 20


@pytest.mark.slow
def test_tfmem_measures_the_allocator_peak_of_every_step(accuracy):
    """tfmem's own figure (from step statistics, without resetting TensorFlow's peak)
    against TensorFlow's allocator peak, read here after a reset before every step.

    The peak over the run (from step 1, as the accuracy figures) is TensorFlow's, and no step reads over TensorFlow's figure
    (reporting the process-wide peak would). A single step can read low: up to ~2 MiB
    (10 %) on ResNet at partition size 20, now and then, when allocations outside the
    partitions' traced kernels (uploads on the prefetch thread, first runs of callables)
    set that step's peak. An open gap of the measurement, not of the model."""
    for key, row in accuracy.items():
        ours, tensorflows = row["tfmem_peaks"], row["peaks"]
        warm_ours, warm_tf = max(ours[1:]), max(tensorflows[1:])  # step 1 on, as accuracy
        assert abs(warm_ours - warm_tf) <= max(0.02 * warm_tf, UNTRACED_BYTES), (key, row)
        assert all(0 < o <= 1.02 * t for o, t in zip(ours, tensorflows)), (key, row)


def _within_band(error, above, gap):
    """A band error (negative: measured above the band) within its side's bound."""
    return abs(error) <= max(above if error < 0 else BAND_BELOW_TOLERANCE, gap)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.slow
def test_measured_peak_lies_in_the_band_of_requested_and_chunk_figures(accuracy, path):
    """The measured median (and worst) step lies between the requested-bytes figure and
    the BFC chunk replay's, within BAND_TOLERANCE (BAND_WORST_TOLERANCE) above it and
    BAND_BELOW_TOLERANCE below: the chunk replay is what brings the oneDNN conv nets
    (2.5 MiB outputs in 4 MiB chunks) in."""
    failures = []
    for (p, m, s), r in accuracy.items():
        if p != path:
            continue
        gap = BAND_GAPS.get((p, m, s), 0)
        if not _within_band(r["band_error"], BAND_TOLERANCE[p], gap) \
                or not _within_band(r["band_worst_error"], BAND_WORST_TOLERANCE[p], gap):
            failures.append(
                f"{m} partition_size={s}: predicted {r['predicted'] / MIB:.2f} MiB requested, "
                f"{r['predicted_chunks'] / MIB:.2f} MiB in chunks; measured "
                f"{r['measured'] / MIB:.2f} MiB ({r['band_error']:+.1%}), worst "
                f"{r['worst'] / MIB:.2f} MiB ({r['band_worst_error']:+.1%})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.slow
def test_one_region_measured_peak_lies_in_the_band(one_region, path):
    """On an allocator that holds its memory as one region (a GPU; the emulated device
    after reserve_emulated_memory), the measured median (and worst) step lies in the band
    within the tolerances of grown regions: the chunk replay starts from the regions
    reserve_emulated_memory took (a small first region, then the large one)."""
    models, sizes = ONE_REGION
    assert {(m, s) for p, m, s in one_region if p == path} == \
        {(m, s) for m in models for s in sizes}
    failures = []
    for (p, m, s), r in one_region.items():
        if p != path:
            continue
        if not _within_band(r["band_error"], BAND_TOLERANCE[p], 0) \
                or not _within_band(r["band_worst_error"], BAND_WORST_TOLERANCE[p], 0):
            failures.append(
                f"{m} partition_size={s}: predicted {r['predicted'] / MIB:.2f} MiB requested, "
                f"{r['predicted_chunks'] / MIB:.2f} MiB in chunks; "
                f"measured {r['measured'] / MIB:.2f} MiB ({r['band_error']:+.1%}), worst "
                f"{r['worst'] / MIB:.2f} MiB ({r['band_worst_error']:+.1%})")
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_budget_modes_bound_plus_margin_covers_the_worst_step(accuracy):
    """Budget mode plans with device copies held to the end of each partition, to
    (1 - margin) of the budget: on the kernel path capped runs use (oneDNN off, which
    raises ResourceExhaustedError at a cap where oneDNN crashed), even the worst step
    fits that bound, the known gaps of the requested figure included (the bound counts
    chunks).  With oneDNN, budget mode learns the rest from its first measured step
    (tests/test_measure.py)."""
    for key, row in accuracy.items():
        if key[0] == "eigen":
            assert row["worst"] * (1 - DEFAULT_MARGIN) <= row["planned"], (key, row)


@pytest.mark.slow
def test_smaller_partitions_predict_and_measure_less(accuracy):
    for path in PATHS:
        for model in ("resnet", "rnn", "mlp", "moe"):
            whole, smallest = accuracy[path, model, SIZES[0]], accuracy[path, model, SIZES[-1]]
            assert smallest["predicted"] < whole["predicted"], (path, model)
            assert smallest["measured"] < whole["measured"], (path, model)


# --------------------------------------------------------------------------
# pure properties: plans and traces, no step runs


def _plan(swap, partition_size=4):
    # The proof's MLP: every tensor has a static shape.
    graph, x, loss, train, _ = build_model(tf, layers=6, batch=64, width=128, seed=0)
    return make_plan(analyse([loss], [train], [x]), partition_size, SwapPolicy(swap, 2, 1, 0))


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
        # The BFC replay holds the same allocations, each in a chunk at least as large.
        assert p.device_peak_chunks >= p.device_peak
    assert trace.peak_device_chunks == max(p.device_peak_chunks for p in trace.partitions)
    bound = simulate(plan, chunks=True)
    assert [p.device_peak for p in bound.partitions] == [
        max(p.device_peak, p.device_peak_chunks) for p in trace.partitions]
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
    return model, make_plan(analyse([model.loss], [model.train], [x]), partition_size)


def test_a_search_predicts_each_candidate_as_a_lone_simulation_does():
    """A search's simulations share working sets and try partitions from the one that
    starts with the most resident down: the trace is the plan-order walk's, and a
    candidate is rejected whichever partition goes over, first or last."""
    plan = _plan("auto")
    view = plan.view
    alone = simulate(plan, early_frees=False, chunks=True)
    assert len({p.device_before for p in alone.partitions}) > 2  # an order to try in
    share = CandidateShare(TensorSizes(view, None))
    for _ in range(2):  # found, then taken from the share
        assert simulate(plan, early_frees=False, chunks=True, share=share,
                        give_up=lambda memory: False) == alone
    for over in (0, len(plan.partitions) - 1):
        for searched in (share, CandidateShare(TensorSizes(view, None))):
            assert simulate(plan, early_frees=False, chunks=True, share=searched,
                            give_up=lambda memory, over=over: memory.index == over) is None
    # a working set over the budget, in the partition that starts with the least resident
    least = min(alone.partitions, key=lambda p: (p.device_before, -p.index))
    assert least.device_peak_requested > least.device_before
    share = CandidateShare(TensorSizes(view, None))
    assert simulate(plan, early_frees=False, chunks=True, share=share,
                    give_up=lambda memory: memory.index == least.index
                    and memory.device_peak > memory.device_before) is None


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
        # a local session chains its copies (op_order.chained_order)
        independent = make_plan(analyse([model.loss], [model.train], [x], chained=True), 10)
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
    assert trace.peak_device_chunks >= trace.peak_device


def _two_products(view_of_first):
    """x -> a = x @ w1, b = x @ w2 -> a + b, with `a` read through `view_of_first`."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [512, 512], name="x")
        w1 = tf.constant(np.ones((512, 512), np.float32))
        w2 = tf.constant(np.ones((512, 512), np.float32))
        a = tf.matmul(x, w1, name="a")
        seen = view_of_first(a)
        with tf.control_dependencies([seen]):  # `a`'s view runs before b exists
            b = tf.matmul(x, w2, name="b")
        out = tf.add(seen, b, name="out")
    return make_plan(analyse([out], [], [x]), 100)


@pytest.mark.parametrize("view", [
    lambda a: tf.identity(a),
    lambda a: tf.reshape(tf.reshape(a, [-1]), [512, 512]),
    lambda a: tf.identity_n([a, a])[1],
])
def test_a_view_keeps_the_buffer_it_views_until_its_last_reader(view):
    """TensorFlow's views (Identity, Reshape) share their input's buffer: reading `a` through
    one keeps `a` alive as long as reading it directly does, so the peak is the same."""
    direct = simulate(_two_products(lambda a: a))
    viewed = simulate(_two_products(view))
    # (a Reshape's shape constants add a few bytes of state)
    assert viewed.peak_device - viewed.state_bytes == direct.peak_device - direct.state_bytes
    assert viewed.peak_device_chunks - viewed.state_bytes >= \
        direct.peak_device - direct.state_bytes
    # a and b alive at once (the sum forwards one of them), besides the state.
    assert direct.peak_device - direct.state_bytes >= 2 * 512 * 512 * 4
