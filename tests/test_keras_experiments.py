"""The Keras experiments (experiments/keras_common.py) and their models (tfmem/cli/keras_models.py).

In this process: tiny versions of the 3D U-Net and the Transformer trained by
plain `fit`, by tfmem in small partitions with every boundary tensor swapped,
and with every block under `tf.recompute_grad`: the same losses, bit for bit.
(ResNet-50 is keras.applications' own, with no tiny version: its first step
alone traces for a minute here; the experiment's quick run covers it.)

In child processes, as the search runs them: one tiny Transformer trial per
system kind (plain fit, a Keras rematerialisation mode that fails on the
TensorFlow backend, tfmem in budget mode under an emulated cap), then the
reports built from them.
"""

import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tfmem.cli import keras_models

from experiments import keras_common, keras_resnet50, keras_transformer, keras_unet3d
from experiments.harness import cap, child, experiment, options, reports, search

STEPS = 3


def _fit(model, x, y, partitioned=False):
    import tfmem  # pylint: disable=import-outside-toplevel
    if partitioned:
        tfmem.keras.partitioned(model, partition_size=40, swap="all",
                                options=tfmem.Options(swap_min_bytes=0))
    history = model.fit(x, y, batch_size=len(x), epochs=STEPS, shuffle=False, verbose=0)
    if partitioned:
        last = tfmem.keras.train_step_of(model).last_step
        assert last.partitions > 3 and last.swapped_out > 0  # a partitioned, swapped step
    return history.history["loss"]


TINY = {
    "unet3d": (lambda recompute: keras_models.unet3d(8, filters=2, recompute_blocks=recompute),
               lambda: keras_models.unet3d_data(1, 8)),
    "transformer": (lambda recompute: keras_models.transformer(
        16, d_model=16, heads=2, layers=2, ff=32, vocab=32, recompute_blocks=recompute),
                    lambda: keras_models.transformer_data(2, 16, vocab=32)),
}


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.slow
def test_tfmem_and_recomputed_blocks_train_as_plain_fit(name):
    build, data = TINY[name]
    x, y = data()
    plain = _fit(build(False), x, y)
    assert len(plain) == STEPS and all(math.isfinite(v) for v in plain)
    assert plain[-1] != plain[0]  # it trains
    assert _fit(build(False), x, y, partitioned=True) == plain
    recomputed = build(True)
    assert any(type(layer).__name__ == "Recomputed" for layer in recomputed.layers)
    assert _fit(recomputed, x, y) == plain


def test_models_refuse_sizes_they_cannot_take():
    with pytest.raises(ValueError, match="multiple of 4"):
        keras_models.unet3d(10)
    with pytest.raises(ValueError):
        keras_unet3d.EXPERIMENT.index_of(10)
    with pytest.raises(ValueError):
        keras_transformer.EXPERIMENT.index_of(40)
    assert keras_transformer.EXPERIMENT.sizes(keras_transformer.EXPERIMENT.index_of(48)) == 48


def test_systems_of_each_experiment():
    assert keras_resnet50.EXPERIMENT.systems == (
        "plain", "remat-full", "remat-activations", "remat-larger_than", "remat-list_of_layers",
        "tfmem", "tfmem+remat-activations")  # ResNet50 is not written in blocks
    assert "recompute-blocks" in keras_unet3d.EXPERIMENT.systems
    assert "recompute-blocks" in keras_transformer.EXPERIMENT.systems
    assert keras_common.remat_mode("tfmem+remat-activations") == "activations"
    assert keras_common.remat_mode("tfmem") is None
    assert experiment.is_tfmem("tfmem+remat-activations") and not experiment.is_tfmem("plain")


def test_steady_times_start_after_the_last_change_of_plan():
    times = [9.0, 1.0, 5.0, 2.0, 2.0, 2.0]
    assert keras_common.steady_times(times, [None] * 6) == times[1:]
    assert keras_common.steady_times(times, [4, 4, 6, 6, 6, 6]) == [2.0, 2.0, 2.0]
    assert keras_common.enough_steps(times, [None] * 6, 6)
    assert not keras_common.enough_steps(times, [4, 4, 6, 6, 6, 6], 6)  # 3 after the change
    assert keras_common.enough_steps(times + [2.0] * 2, [4, 4, 6, 6, 6, 6, 6, 6], 6)
    assert keras_common.enough_steps(times[:2], [None] * 2, 2)  # --steps 2: one to time
    assert not keras_common.enough_steps(times[:2], [3, 5], 2)


# --------------------------------------------------------------------------
# trials in child processes, and the reports


CAP = 64
TRIAL = ["--find-max", "--device-memory", str(CAP), "--steps", "2", "--batch-size", "2",
         "--layers", "1", "--d-model", "16", "--heads", "2", "--vocab", "32",
         "--intra-op-threads", "1", "--inter-op-threads", "1"]
SYSTEMS = ("plain", "remat-full", "tfmem")


@pytest.fixture(scope="module")
def trials():
    args = options.parse_args(keras_transformer.EXPERIMENT, TRIAL)
    # tfmem once more with a budget below what the step's largest op needs alone
    # (its cap held as one region, as a GPU's allocator holds it).
    starved = options.parse_args(keras_transformer.EXPERIMENT,
                                TRIAL + ["--budget", "1", "--allocator", "one-region"])
    with ThreadPoolExecutor(len(SYSTEMS) + 1) as pool:
        futures = {system: pool.submit(child.spawn_trial, keras_transformer.EXPERIMENT, args,
                                       system, 16, 240) for system in SYSTEMS}
        futures["starved"] = pool.submit(child.spawn_trial, keras_transformer.EXPERIMENT,
                                         starved, "tfmem", 256, 240)
        return args, {system: future.result() for system, future in futures.items()}


@pytest.mark.slow
def test_trials_in_child_processes(trials):
    _, results = trials
    plain, remat, tfm = results["plain"], results["remat-full"], results["tfmem"]
    for result in (plain, tfm):
        assert result["status"] == "ok", result.get("error") or result.get("stderr_tail")
        assert result["device_memory_mib"] == CAP and result["kernel_path"] == "oneDNN off"
        assert len(result["losses"]) == 2 and 0 < result["peak_bytes"] <= CAP << 20
        assert result["state"]["total"] == result["state_bytes"] > 4 * 4 * 1000
        assert result["largest_op_bytes"] > 0 and result["seconds_per_sample"] > 0
    assert tfm["losses"] == plain["losses"]
    assert tfm["tfmem"]["partition_size"] == "auto" and tfm["tfmem"]["partitions"] >= 1
    # what TensorFlow's peak counts beside the plan's own tensors: at least the state
    assert tfm["tfmem"]["resident_bytes"] >= tfm["state_bytes"] // 3, tfm["tfmem"]
    assert keras_common.predicted_peak(tfm["tfmem"]) > tfm["tfmem"]["predicted_peak_bytes"]
    # Keras's full rematerialisation cannot run a functional model's fit on the TensorFlow
    # backend: a result of the experiment, not a failure of the run.
    assert remat["status"] == "unsupported" and not experiment.is_size_limit(remat)
    assert "custom_gradient" in remat["error"]


@pytest.mark.slow
def test_what_stopped_tfmem_is_its_plans_figures(trials):
    """A budget nothing fits: the trial records the figures of tfmem's own error."""
    _, results = trials
    starved = results["starved"]
    assert starved["status"] == "budget" and experiment.is_size_limit(starved), (
        starved["error"], starved.get("stderr_tail"))
    assert starved["allocator"] == "one-region"
    assert 0.9 * (CAP << 20) <= starved["reserved_region_bytes"] <= CAP << 20
    assert results["tfmem"]["reserved_region_bytes"] is None  # the grown allocator
    figures = starved["budget_figures"]
    assert figures is not None, starved["error"]
    assert figures["budget_mib"] == 1.0
    assert figures["one_op_mib"] > figures["limit_mib"] and figures["largest_op_mib"] > 0
    assert f"'{figures['largest_op'].rsplit(' (', 1)[0]}'" in starved["error"]
    text = keras_common.what_stopped(starved)
    assert text.startswith("256: one op per partition needs")
    assert f"{figures['one_op_mib']:g} MiB of {figures['limit_mib']:g} MiB allowed" in text
    assert figures["allocator_refused"] == ("cannot serve" in starved["error"]) == (
        "allocator cannot serve" in text)


def test_what_stopped_plain_fit_is_the_allocation_it_was_refused():
    error = ("ResourceExhaustedError: OOM when allocating tensor with shape[4,4,320,320] and "
             "type float on /job:localhost")
    assert keras_common.failed_allocation(error) == (
        round(4 * 4 * 320 * 320 * 4 / 2**20, 1), "[4,4,320,320] float")
    assert keras_common.what_stopped(dict(size=320, error=error)).startswith("320: OOM")
    assert keras_common.what_stopped(dict(size=320, error="ValueError: no")) is None


def test_the_predicted_peak_counts_what_the_device_held_as_tensorflows_peak_does():
    """TensorFlow's peak counts the model's variables and the batch, which a tfmem.function
    plan's own peak leaves out: the table's predicted peak adds them where recorded."""
    mib = 1 << 20
    assert keras_common.predicted_peak(dict(predicted_peak_bytes=30 * mib,
                                            resident_bytes=12 * mib)) == 42 * mib
    assert keras_common.predicted_peak(dict(predicted_peak_bytes=30 * mib)) == 30 * mib
    assert keras_common.predicted_peak({}) is None


def test_state_share_derives_the_cap_from_the_state(monkeypatch, tmp_path):
    args = options.parse_args(keras_transformer.EXPERIMENT, [
        "--find-max", "--cap-base", "32", "--state-share", "0.33"])
    state = 3 * 2**20 + 12345

    def plain_peak(experiment, trial_args, out=None):
        return dict(base_size=trial_args.cap_base, size_name="seq_len", factor=1.0,
                    kernel_path="oneDNN off", plain_peak_mib=20.5, cap_mib=21,
                    plain_peaks_mib=[20.5], error=None, trial=dict(state_bytes=state))

    monkeypatch.setattr(cap, "derive_cap", plain_peak)
    info = keras_common.derive_cap(keras_transformer.EXPERIMENT, args)
    assert info["cap_mib"] == math.ceil(state / 0.33 / 2**20)
    assert info["cap_mib"] * 0.33 * 2**20 >= state > (info["cap_mib"] - 1) * 0.33 * 2**20
    assert info["state_share"] == 0.33 and "/ 0.33" in cap.cap_note(
        keras_transformer.EXPERIMENT, args, info)
    args.device_memory, args.out_dir = info["cap_mib"], tmp_path
    assert reports.output_stem(keras_transformer.EXPERIMENT, args).name.endswith("-state0.33")
    with pytest.raises(SystemExit):  # only the two settings of the experiments
        options.parse_args(keras_transformer.EXPERIMENT, ["--find-max", "--state-share", "0.5"])
    # a cap given is the cap: --quick's share neither derives it nor names the outputs
    given = options.parse_args(keras_resnet50.EXPERIMENT, ["--quick", "--device-memory", "500"])
    given.out_dir = tmp_path
    assert given.state_share is None and given.device_memory == 500
    assert reports.output_stem(keras_resnet50.EXPERIMENT, given).name == "keras_resnet50-quick"
    assert options.parse_args(keras_resnet50.EXPERIMENT, ["--quick"]).state_share == 0.1
    with pytest.raises(SystemExit):
        options.parse_args(keras_resnet50.EXPERIMENT,
                           ["--quick", "--device-memory", "500", "--state-share", "0.33"])


@pytest.mark.slow
def test_reports_of_the_trials(trials, tmp_path):
    args, results = trials
    args.out_dir, args.tag = tmp_path, "tiny"
    summaries = []
    for system in SYSTEMS:
        result = results[system]
        failed = not result["ok"]
        outcome = dict(best=0 if failed else result["index"], failed_at=None,
                       trials=[result], stopped="failure" if failed else "max-size",
                       failure=result if failed else None, seconds=1.0)
        summaries.append(search.summarise(keras_transformer.EXPERIMENT, args, system, outcome))
    assert reports.run_failure(summaries) is None  # the refused mode is a result
    extra = keras_common.report(args, summaries, None)
    rows = {row["system"]: row for row in extra.data["comparison"]}
    assert rows["tfmem"]["losses_equal"] and rows["tfmem"]["losses_size"] == 16
    assert rows["tfmem"]["ratio"] == 1.0 and rows["remat-full"]["max_size"] is None
    assert rows["plain"]["state_share"] == pytest.approx(
        results["plain"]["state_bytes"] / (CAP << 20), abs=0.01)
    reports.write_reports(keras_transformer.EXPERIMENT, args, summaries, 3.0,
                         out=lambda _: None, extra=extra)
    markdown = (tmp_path / "keras_transformer-tiny.md").read_text()
    assert "RESULT system=tfmem max=16 ratio=1.00" in markdown
    assert "the system refused the model" in markdown and "custom_gradient" in markdown
    assert "| tfmem | - | 16 | 1.00 |" in markdown and "16: equal" in markdown
    saved = json.loads((tmp_path / "keras_transformer-tiny.json").read_text())
    assert saved["provenance"]["kernel_path"]["plain"] == "oneDNN off"
    assert set(saved["provenance"]["kernel_path"]) == set(keras_transformer.EXPERIMENT.systems)
    assert np.isclose(saved["extra"]["comparison"][0]["ratio"], 1.0)
    # The docs' table is rebuilt from the stored trials: the same as the run wrote.
    assert keras_common.stored_report(saved) == extra.markdown


def test_largest_working_set_skips_ops_that_forward_their_inputs():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    @tf.function
    def step(a, b):
        product = tf.matmul(a, b)  # [64, 32] x [32, 16] -> [64, 16]: 12 KiB
        return tf.identity_n([a, a, a, a, a, a, a, a, product])  # nine inputs, 74 KiB

    concrete = step.get_concrete_function(tf.TensorSpec([64, 32]), tf.TensorSpec([32, 16]))
    size, name, kind = keras_common._working_sets(tf, concrete)  # pylint: disable=protected-access
    assert kind == "MatMul" and size == 4 * (64 * 32 + 32 * 16 + 64 * 16), name


def test_a_system_never_run_at_a_size_plain_trained_gets_a_trial_there(monkeypatch):
    args = options.parse_args(keras_transformer.EXPERIMENT, TRIAL)
    spawned = []

    def fake_trial(experiment, trial_args, system, size, timeout):
        spawned.append((system, size))
        return dict(system=system, size=size, ok=True, status="ok", losses=[1.0, 0.5])

    def summary(system, sizes):
        trials = [dict(system=system, size=size, ok=ok, status="ok" if ok else "oom",
                       losses=[1.0, 0.5] if ok else []) for size, ok in sizes]
        best = max((size for size, ok in sizes if ok), default=None)
        return dict(system=system, max_size=best, all_trials=trials)

    monkeypatch.setattr(keras_common, "spawn_trial", fake_trial)
    summaries = [summary("plain", [(112, True), (128, False)]),
                 summary("recompute-blocks", [(112, True), (224, True)]),
                 summary("tfmem", [(224, True), (448, False)]),
                 summary("remat-full", [(224, False)])]
    keras_common.check_losses(keras_transformer.EXPERIMENT, args, summaries)
    assert spawned == [("tfmem", 112)]  # recompute-blocks ran at 112; remat-full trained none
    assert summaries[2]["all_trials"][-1]["losses_check"] is True
