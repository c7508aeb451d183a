"""The experiments' trials: resnet.py, moe.py and deepspeech.py through the harness.

One tiny ResNet trial per system, each in its own process as the search runs
them (the emulated cap must be set before TensorFlow starts), the options that
reach a trial, the steady state, the cap derived from plain TensorFlow's peak,
and tiny MoE and DeepSpeech trials.  tfmem runs the tiny ResNet in small
partitions, so its losses are those of a partitioned, swapped step.  (Its
peak is not compared with plain TensorFlow's here: without oneDNN, one
convolution gradient's im2col buffer, up to 30 MB whatever the batch, sets
both peaks of so small a model.)  The three trials run concurrently.
"""

import json
import math
import os
import statistics
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from experiments import deepspeech, moe, resnet
from experiments.harness import cap, child, experiment, options, reports, steady

MIB = 1 << 20
CAP = 256
# Threads pinned, so that the peaks do not depend on the machine's core count.  Steps
# adapt: the first, then 2 steady ones after the last re-plan (at most 4 steps).
TINY = ["--device-memory", str(CAP), "--steady-steps", "2", "--max-steps", "4", "--image", "32",
        "--batch-size", "8", "--inter-op-threads", "1", "--intra-op-threads", "1"]
# Partitions of 40 ops (the 8-layer step has several hundred) and every boundary
# tensor eligible for swapping: the trial runs a partitioned, swapped step.
TFMEM_PARTITIONED = ["--partition-size", "40", "--swap-min-bytes", "0"]


@pytest.fixture(scope="module")
def trials():
    """{system: result} of one 8-layer trial per system, each in a fresh process."""
    plain = options.parse_args(resnet.EXPERIMENT, ["--find-max"] + TINY)
    partitioned = options.parse_args(resnet.EXPERIMENT, ["--find-max"] + TINY + TFMEM_PARTITIONED)
    with ThreadPoolExecutor(len(experiment.SYSTEMS)) as pool:
        futures = {system: pool.submit(child.spawn_trial, resnet.EXPERIMENT,
                                       partitioned if system == "tfmem" else plain, system, 8, 180)
                   for system in experiment.SYSTEMS}
        return {system: future.result() for system, future in futures.items()}


@pytest.mark.parametrize("system", experiment.SYSTEMS)
@pytest.mark.slow
def test_one_trial_per_system_prints_its_json_result(trials, system):
    result = trials[system]
    assert result["status"] == "ok", result.get("error") or result.get("stderr_tail")
    assert result["ok"] is True
    assert result["system"] == system
    assert (result["size_name"], result["size"], result["index"]) == ("layers", 8, 1)
    assert result["device_memory_mib"] == CAP
    assert result["batch_size"] == 8
    assert result["parameters"] == resnet.parameters(8) > 0
    assert len(result["losses"]) == result["steps"] and all(math.isfinite(v)
                                                             for v in result["losses"])
    assert result["peak_bytes"] > 0  # TensorFlow's BFC allocator keeps figures on every path
    assert result["state_bytes"] > 4 * result["parameters"]  # weights, momentum, BN averages


@pytest.mark.parametrize("system", experiment.SYSTEMS)
@pytest.mark.slow
def test_a_trial_runs_until_its_steady_state_and_reports_it_apart(trials, system):
    """The first step, the re-plans and the steady state (the median of the steps after the
    last re-plan), from the trial's own step times; it stops once it has 2 steady steps."""
    result = trials[system]
    times = result["step_times"]
    # no re-plans: plain TensorFlow, and tfmem at a fixed partition size learns nothing
    assert result["replans"] == len(result["replan_steps"]) == result["recompiles"] == 0
    assert result["steps"] == len(times) == 3
    assert result["first_step_seconds"] == times[0]
    assert result["steady_step_count"] == 2
    assert result["steady_seconds"] == statistics.median(times[-2:])
    assert result["throughput"] == pytest.approx(8 / result["steady_seconds"])
    assert result["steady_ms_per_unit"] == pytest.approx(
        result["steady_seconds"] * 1000 / (8 * 8))  # per layer-image: 8 layers, batch 8
    assert result["work_unit"] == "layer-image"


@pytest.mark.slow
def test_systems_are_what_they_say(trials):
    assert trials["tf"]["grappler"] is None and trials["tf"]["tfmem"] is None
    assert trials["grappler"]["grappler"] == experiment.GRAPPLER_MEMORY_OPTIMIZATION == "HEURISTICS"
    info = trials["tfmem"]["tfmem"]
    assert info["partition_size"] == 40 and info["swap_min_bytes"] == 0
    assert info["partitions"] > 5 and info["swapped_out_bytes"] > 0
    # Plain TensorFlow runs without oneDNN (its kernels crashed at a full cap); tfmem
    # runs the path --onednn asks for (default off).  Both are set, never inherited.
    for system in experiment.SYSTEMS:
        assert trials[system]["kernel_path"] == "oneDNN off"


@pytest.mark.slow
def test_same_losses_on_every_system(trials):
    # Same graph, seeds and data: tfmem's partitioned, swapped step computes what
    # plain TensorFlow computes.
    reference = trials["tf"]["losses"]
    for system in ("grappler", "tfmem"):
        assert trials[system]["losses"] == pytest.approx(reference, rel=1e-4)


def test_a_trial_over_its_time_limit_is_a_timeout():
    args = options.parse_args(resnet.EXPERIMENT, ["--find-max"] + TINY)
    result = child.spawn_trial(resnet.EXPERIMENT, args, "tf", 8, timeout=0.5)
    assert result["status"] == "timeout" and not result["ok"]
    assert "within" in result["error"]


IDLE_IN_A_STEP = """
import sys, time
print("PHASE step 0 0.1", file=sys.stderr, flush=True)
time.sleep(60) if sys.argv[-1] == "idle" else [0 for _ in iter(int, 1)]
"""


@pytest.mark.parametrize("kind", ["idle", "busy"])
def test_a_trial_idle_in_a_step_is_waiting_for_memory(tmp_path, monkeypatch, kind):
    # TensorFlow's allocator holds a step waiting when memory runs out (10 s for each
    # failing allocation): a step idle for IDLE_SECONDS ends as a memory limit, one
    # that computes runs into the time limit.
    script = tmp_path / "trial.py"
    script.write_text(IDLE_IN_A_STEP)
    monkeypatch.setattr(child, "IDLE_SECONDS", 2.0)
    monkeypatch.setattr(child, "POLL_SECONDS", 0.2)
    monkeypatch.setattr(child, "trial_options", lambda experiment, args: [kind])
    fake = types.SimpleNamespace(script=str(script), size="layers", name="fake",
                                 index_of=lambda size: size, unit="images")
    args = types.SimpleNamespace(batch_size=1, device_memory=None, onednn=0)
    result = child.spawn_trial(fake, args, "tf", 8, timeout=6)
    if kind == "idle":
        assert result["status"] == "memory-wait", result
        assert result["seconds"] < 6 and "step 0" in result["error"]
        assert experiment.is_size_limit(result)
    else:
        assert result["status"] == "timeout", result


def test_single_trial_command_line_exit_code_and_json():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "resnet.py"), "--system", "tf",
         "--layers", "9"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "even" in proc.stderr  # 9 layers do not exist


# --------------------------------------------------------------------------
# harness/steady.py: which steps are steady, and seeing a re-plan through TFMemSession's listener


def test_the_steady_state_is_the_median_after_the_last_replan():
    times = [9.0, 4.0, 1.0, 1.2, 3.0, 1.1, 0.9, 1.0, 1.3, 1.0]
    planned = [True, True, False, False, True, False, False, False, False, False]
    split = steady.split(times, planned, compiled=[True, True, False, False, False])
    assert split["first_step_seconds"] == 9.0
    assert split["replans"] == 2 and split["replan_steps"] == [1, 4]
    assert split["recompiles"] == 1  # step 1 compiled its new plan, step 4 kept its plan
    assert split["steady_step_count"] == 5
    assert split["steady_seconds"] == statistics.median(times[5:])
    # fewer than the steady steps asked for after the last re-plan: not measured
    assert steady.split(times, planned, steady_steps=6)["steady_seconds"] is None
    assert steady.split(times[:8], planned)["steady_seconds"] is None
    # plain TensorFlow: no listener, only the first step sets up
    assert steady.split(times, [])["steady_step_count"] == len(times) - 1
    assert steady.split([], [])["first_step_seconds"] is None
    assert steady.ms_per_unit(0.5, 10, 20) == pytest.approx(2.5)  # 500 ms / 200 units
    assert steady.ms_per_unit(None, 10, 20) is None


def test_a_trial_runs_until_enough_steps_follow_the_last_replan():
    assert not steady.done([True, False, False], None, 20, steady_steps=3)
    assert steady.done([True, False, False, False], None, 20, steady_steps=3)
    assert not steady.done([True, False, False, False, True, False], None, 20, steady_steps=3)
    assert steady.done([True] * 6, None, 6, steady_steps=3)  # bounded by max_steps
    assert steady.done([True, True], 2, 20) and not steady.done([True], 2, 20)  # --steps N


REPLAN_SCRIPT = r"""
import json, logging, os, sys, tempfile
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tfmem
tfmem.emulate_accelerator(512)
import tensorflow as tf
from experiments.harness import steady
from tfmem.cli import models
from tfmem.memory import scratch
tf1 = tf.compat.v1
config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
model = models.resnet(blocks=(1, 1, 1), image=16)
feed, fetches = model.feed(8), [model.train, model.loss]
sess = tf1.Session(graph=model.graph, config=config)
tfmem.TFMemSession(sess, partition_size=100000).run(model.init)
# A stale kernel scratch cache (every kernel without scratch): the first step measures
# over its prediction and budget mode plans the request again before the next step.
view = tfmem.TFMemSession(sess, partition_size=100000).plan(fetches, feed).view
cache = os.path.join(tempfile.mkdtemp(), "kernels.json")
scratch.write_stale_cache(cache, model.graph, view, {t.name: v.shape for t, v in feed.items()},
                          sess)
os.environ[scratch.CACHE_ENV] = cache
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("tfmem").addHandler(handler)
logging.getLogger("tfmem").setLevel(logging.INFO)
tfs = tfmem.TFMemSession(sess, device_memory_budget="256MiB")
watch = steady.ReplanWatch(tfs)
logs = []
for step in range(5):
    records.clear()
    tfs.run(fetches, feed if step < 3 else model.feed(4))  # a new batch size at step 3
    logs.append(list(records))
print(json.dumps(dict(planned=watch.planned, compiled=watch.compiled, logs=logs)))
"""


@pytest.mark.slow
def test_the_replan_watch_sees_budget_mode_plan_again():
    """A real budget-mode session: the step after one that learned plans again (here the
    same plan, predicted anew: nothing compiled), as tfmem's own log says; a new feed
    shape plans and compiles; the steps between plan nothing."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFMEM_SCRATCH_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", REPLAN_SCRIPT],
                          capture_output=True, text=True, timeout=300, check=False, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    learned = ["planning the request again" in " ".join(lines) for lines in out["logs"]]
    assert learned[0], out["logs"][0]  # the stale cache made the first step learn
    assert out["planned"] == [True] + learned[:2] + [True, False]
    assert out["planned"] == [True, True, False, True, False]
    assert out["compiled"][0] and out["compiled"][3] and not out["compiled"][2]
    assert steady.split([1.0] * 5, out["planned"], out["compiled"])["replan_steps"] == [1, 3]


def test_layers_map_to_third_stage_blocks():
    assert [resnet.layers_of(k) for k in (1, 2, 25)] == [8, 10, 56]
    assert [resnet.blocks_of(n) for n in (8, 10, 56)] == [1, 2, 25]
    for bad in (6, 7, 9):
        with pytest.raises(ValueError):
            resnet.blocks_of(bad)


def test_steps_adapt_unless_fixed_and_reach_the_trial():
    args = options.parse_args(resnet.EXPERIMENT, ["--quick"])
    assert args.steps is None and args.steady_steps == steady.STEADY_STEPS == 5
    child_options = options.trial_options(resnet.EXPERIMENT, args)
    assert "--steps" not in child_options
    assert child_options[child_options.index("--steady-steps") + 1] == "5"
    assert child_options[child_options.index("--max-steps") + 1] == str(args.max_steps)
    fixed = options.trial_options(resnet.EXPERIMENT,
                                 options.parse_args(resnet.EXPERIMENT, ["--quick", "--steps", "7"]))
    assert fixed[fixed.index("--steps") + 1] == "7"
    with pytest.raises(SystemExit):  # the first step is never steady: max must exceed
        options.parse_args(resnet.EXPERIMENT, ["--quick", "--steady-steps", "5",
                                              "--max-steps", "5"])


def test_parse_args_defaults_and_quick():
    quick = options.parse_args(resnet.EXPERIMENT, ["--quick"])
    # No fixed cap: it is derived from plain TensorFlow's peak at 16 layers on this machine.
    assert quick.find_max and quick.device_memory is None and quick.cap_base == 16
    assert quick.trial_timeout == 60 and quick.batch_size == 16
    assert quick.partition_size == "auto" and quick.onednn == 0
    with pytest.raises(SystemExit):  # a search needs a cap or a size to derive it from
        options.parse_args(resnet.EXPERIMENT, ["--find-max"])
    given = options.parse_args(resnet.EXPERIMENT, ["--quick", "--device-memory", "100",
                                                  "--partition-size", "50"])
    assert given.device_memory == 100 and given.partition_size == 50
    with pytest.raises(SystemExit):
        options.parse_args(resnet.EXPERIMENT, ["--layers", "8"])  # one trial needs --system


@pytest.mark.slow
def test_the_cap_is_derived_from_plain_tensorflow_on_this_machine():
    args = options.parse_args(resnet.EXPERIMENT, ["--find-max", "--cap-base", "8",
                                                 "--cap-factor", "1.5"] + TINY[2:])
    info = cap.derive_cap(resnet.EXPERIMENT, args)
    trial = info["trial"]
    assert trial["ok"] and trial["system"] == "tf" and trial["size"] == 8
    assert trial["device_memory_mib"] is None  # measured without a cap, same allocator
    assert trial["kernel_path"] == info["kernel_path"] == "oneDNN off"
    assert info["cap_mib"] == math.ceil(trial["peak_bytes"] * 1.5 / MIB)
    assert info["plain_peak_mib"] == round(trial["peak_bytes"] / MIB, 2)
    # the median of as many processes
    assert len(info["plain_peaks_mib"]) == cap.CAP_TRIALS
    assert info["plain_peak_mib"] == sorted(info["plain_peaks_mib"])[cap.CAP_TRIALS // 2]


# --------------------------------------------------------------------------
# moe.py: a tiny mixture of experts, plain TensorFlow against tfmem


# Small partitions and no swap threshold, so tfmem really cuts and swaps this tiny graph.
MOE_TINY = ["--device-memory", str(CAP), "--steps", "2", "--layers", "1", "--seq-len", "16",
            "--d-model", "32", "--d-ff", "32", "--heads", "2", "--vocab", "32",
            "--partition-size", "40", "--swap-min-bytes", "0"]


@pytest.fixture(scope="module")
def moe_trials():
    """{system: result} of one 3-expert trial for tf, tfmem and tfmem with --partial-runs
    ("tfmem-prun"), each in a fresh process."""
    args = options.parse_args(moe.EXPERIMENT, ["--find-max"] + MOE_TINY)
    prun = options.parse_args(moe.EXPERIMENT, ["--find-max", "--partial-runs"] + MOE_TINY)
    runs = {"tf": (args, "tf"), "tfmem": (args, "tfmem"), "tfmem-prun": (prun, "tfmem")}
    with ThreadPoolExecutor(3) as pool:
        futures = {name: pool.submit(child.spawn_trial, moe.EXPERIMENT, run_args, system, 3, 120)
                   for name, (run_args, system) in runs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
def test_moe_trials_train_the_same_losses(moe_trials):
    tf_result, tfm_result = moe_trials["tf"], moe_trials["tfmem"]
    for result in (tf_result, tfm_result):
        assert result["status"] == "ok", result.get("error") or result.get("stderr_tail")
        assert (result["size_name"], result["size"], result["unit"]) == ("experts", 3, "pairs")
        assert result["parameters"] == moe.parameters(3, layers=1, d_model=32, d_ff=32, vocab=32,
                                                      seq_len=16)
        assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"])
    info = tfm_result["tfmem"]
    assert info["partition_size"] == 40 and info["partitions"] > 1
    assert info["swapped_out_bytes"] > 0
    # Same graph, seeds and data: partitioned and swapped, tfmem computes the same step.
    assert tfm_result["losses"] == pytest.approx(tf_result["losses"], rel=1e-5)
    assert info["step_paths"] == ["callables"] * 2  # measured steps (measure "sample")
    # --steps 2 is a fixed count: fewer steady steps than the 5 a steady state needs
    assert tfm_result["steps"] == 2 and tfm_result["steady_step_count"] == 1
    assert tfm_result["steady_seconds"] is None and tfm_result["throughput"] is None
    assert tfm_result["first_step_seconds"] == tfm_result["step_times"][0]


@pytest.mark.slow
def test_moe_trial_with_partial_runs_runs_every_step_as_one(moe_trials):
    tf_result, prun = moe_trials["tf"], moe_trials["tfmem-prun"]
    assert prun["status"] == "ok", prun.get("error") or prun.get("stderr_tail")
    info = prun["tfmem"]
    assert info["partial_runs"] is True and info["measure"] == "off"
    assert info["step_paths"] == ["partial run"] * 2 and info["partitions"] > 1
    assert info["swapped_out_bytes"] > 0
    assert prun["losses"] == pytest.approx(tf_result["losses"], rel=1e-5)


def test_partial_runs_option_reaches_the_trial_and_the_report():
    args = options.parse_args(moe.EXPERIMENT, ["--quick", "--partial-runs"])
    assert args.partial_runs and args.measure == "off"  # measured steps would run callables
    child_options = options.trial_options(moe.EXPERIMENT, args)
    assert "--partial-runs" in child_options
    assert child_options[child_options.index("--measure") + 1] == "off"
    kept = options.parse_args(moe.EXPERIMENT, ["--quick", "--partial-runs", "--measure", "sample"])
    assert kept.measure == "sample" and "callables" in reports.step_path_text(vars(kept))
    plain = options.parse_args(moe.EXPERIMENT, ["--quick"])
    assert not plain.partial_runs and plain.measure == "sample"
    assert "--partial-runs" not in options.trial_options(moe.EXPERIMENT, plain)
    assert reports.step_path_text(vars(args)).startswith("partial runs (measure off")
    # budget mode measures partial runs by the process figures: it keeps "sample" and learns
    learns = options.parse_args(moe.EXPERIMENT, ["--quick", "--partial-runs", "--partition-size",
                                                "auto"])
    assert learns.measure == "sample" and "learns" in reports.step_path_text(vars(learns))
    assert reports.step_path_text(vars(plain)) == "callables (measure sample)"
    assert reports.command_line(moe.EXPERIMENT, ["--quick", "--partial-runs"]) == \
        "python experiments/moe.py --quick --partial-runs"


def test_moe_parameters_grow_with_experts():
    one, two = moe.parameters(1), moe.parameters(2)
    assert two - one == 2 * (2 * 64 * 128 + 64)  # per layer: two expert matrices, a gate column
    assert moe.experts_of(48) == 48
    with pytest.raises(ValueError):
        moe.experts_of(0)


def test_moe_quick_and_defaults():
    quick = options.parse_args(moe.EXPERIMENT, ["--quick"])
    assert quick.find_max and quick.device_memory is None and quick.cap_base == 12
    assert quick.batch_size == 8 and quick.partition_size == 200  # the paper's MoE settings
    assert quick.trial_timeout == 60 and quick.start == 4
    assert "--swap-min-bytes" in options.trial_options(moe.EXPERIMENT, quick)
    one = options.parse_args(moe.EXPERIMENT, ["--system", "tfmem", "--experts", "12",
                                             "--partition-size", "auto"])
    assert one.size == 12 and one.partition_size == "auto" and not one.find_max
    with pytest.raises(SystemExit):
        options.parse_args(moe.EXPERIMENT, ["--system", "tf", "--experts", "0"])


# --------------------------------------------------------------------------
# deepspeech.py: a tiny unrolled bidirectional RNN, plain TensorFlow against tfmem


# The paper's partition size 5 (the default) on a 4-frame sequence: many partitions.
DS_TINY = ["--device-memory", str(CAP), "--steps", "2", "--batch-size", "8", "--features", "6",
           "--hidden", "16", "--classes", "5", "--swap-min-bytes", "0"]


@pytest.fixture(scope="module")
def deepspeech_trials():
    """{system: result} of one 4-frame trial for tf and tfmem, each in a fresh process."""
    args = options.parse_args(deepspeech.EXPERIMENT, ["--find-max"] + DS_TINY)
    with ThreadPoolExecutor(2) as pool:
        futures = {system: pool.submit(child.spawn_trial, deepspeech.EXPERIMENT, args, system,
                                       4, 120) for system in ("tf", "tfmem")}
        return {system: future.result() for system, future in futures.items()}


@pytest.mark.slow
def test_deepspeech_trials_train_the_same_losses(deepspeech_trials):
    tf_result, tfm_result = deepspeech_trials["tf"], deepspeech_trials["tfmem"]
    for result in (tf_result, tfm_result):
        assert result["status"] == "ok", result.get("error") or result.get("stderr_tail")
        assert (result["size_name"], result["size"], result["unit"]) == ("seq_len", 4, "sequences")
        assert result["parameters"] == deepspeech.parameters(features=6, hidden=16, classes=5)
        assert len(result["losses"]) == 2 and all(math.isfinite(v) for v in result["losses"])
    assert tf_result["losses"][1] < tf_result["losses"][0]  # it trains
    info = tfm_result["tfmem"]
    assert info["partition_size"] == deepspeech.PAPER_PARTITION_SIZE == 5
    assert info["partitions"] > 20 and info["swapped_out_bytes"] > 0
    # Same graph, seeds and data: cut into partitions of 5 ops and swapped, the same step.
    assert tfm_result["losses"] == pytest.approx(tf_result["losses"], rel=1e-5)


def test_deepspeech_quick_defaults_and_iteration_table(tmp_path):
    quick = options.parse_args(deepspeech.EXPERIMENT, ["--quick"])
    assert quick.batch_size == 128 and quick.partition_size == "auto"
    assert quick.time_seq_lens == [16, 32] and quick.swap_min_bytes == 32 << 10
    assert options.parse_args(deepspeech.EXPERIMENT, ["--find-max", "--device-memory",
                                                     "24"]).partition_size == 5
    assert options.parse_args(deepspeech.EXPERIMENT, ["--quick", "--time-seq-lens",
                                                     "none"]).time_seq_lens == []
    with pytest.raises(SystemExit):  # a bad length stops the run before the search
        options.parse_args(deepspeech.EXPERIMENT, ["--quick", "--time-seq-lens", "8,x"])
    labels = [label for label, _, _ in deepspeech._timed_runs(quick)]  # pylint: disable=protected-access
    assert labels == ["tf", "grappler", "tfmem", "tfmem ps=5"]  # budget mode and the paper's 5
    rows = [{"seq_len": 8, "tf": 0.1, "tf status": "ok", "grappler": None,
             "grappler status": "oom", "tfmem": 0.15, "tfmem status": "ok",
             "tfmem partitions": 1, "tfmem ps=5": 0.4, "tfmem ps=5 status": "ok",
             "tfmem ps=5 partitions": 90}]
    text = deepspeech._iteration_markdown(rows, labels, quick)  # pylint: disable=protected-access
    assert "| 8 | 0.100 | oom | 0.150 | 0.400 | 1 | 90 | 1.50x | 4.00x |" in text
    assert "1.15 s vs 1.56 s" in text  # the paper's numbers beside ours
