"""Shared machinery of the Keras experiments: what a TensorFlow 2 user gains over `fit`.

A Keras experiment (`keras_resnet50.py`, `keras_unet3d.py`,
`keras_transformer.py`) compares, side by side in one run, systems a user of
`model.fit` can reach for when a model does not fit:

* ``plain``: `model.fit`;
* ``remat-<mode>``: the model built under `keras.RematScope(mode=...)`, every
  mode (on the TensorFlow backend Keras wraps the layers in
  `tf.recompute_grad`; a mode that fails is recorded with its error);
* ``recompute-blocks``: every block of a model written in blocks wrapped in
  `tf.recompute_grad` by hand (tfmem/cli/keras_models.py);
* ``tfmem``: `tfmem.keras.partitioned(model, partition_size="auto")`, budget
  mode with the emulated cap as the budget;
* ``tfmem+remat-activations``: both.

The search, the cap, the child processes and the reports are those of
`harness/`; this module adds the Keras trial (one `fit` of one-step epochs
of one seeded batch, so that each logged loss is one step's: `--steps` of
them, and more, up to EXTRA_STEPS, until STEADY_STEPS follow tfmem's last
change of plan) and the report that sets each system beside plain `fit`: time
per sample at its largest size against plain's at plain's largest, the
losses at a size both trained, and what filled the device at the limit.
"""

import argparse
import functools
import os
import re
import statistics
import time

from experiments.harness import steady as steady_figures
from experiments.harness.child import spawn_trial
from experiments.harness.experiment import MIB, Experiment, Extra, is_tfmem
from experiments.harness.reports import cell
from experiments.harness.trial import describe_trial, first_line, report_phase

REMAT_MODES = ("full", "activations", "larger_than", "list_of_layers")
BASELINE = "plain"
LABELS = {"plain": "Keras model.fit",
          **{f"remat-{mode}": f'keras.RematScope(mode="{mode}")' for mode in REMAT_MODES},
          "recompute-blocks": "tf.recompute_grad over every block",
          "tfmem": 'tfmem.keras.partitioned(partition_size="auto")',
          "tfmem+remat-activations": 'tfmem.keras.partitioned + RematScope("activations")'}
STEADY_STEPS = 5  # steps timed after the first and after tfmem's last change of plan
EXTRA_STEPS = 10  # at most this many steps beyond --steps, waiting for STEADY_STEPS


def systems(blocks=True):
    """The systems of an experiment; `blocks`: the model is written in blocks."""
    names = ["plain"] + [f"remat-{mode}" for mode in REMAT_MODES]
    if blocks:
        names.append("recompute-blocks")
    return tuple(names + ["tfmem", "tfmem+remat-activations"])


def remat_mode(system):
    """The keras.RematScope mode a system builds its model under, or None."""
    for part in system.split("+"):
        if part.startswith("remat-"):
            return part[len("remat-"):]
    return None


def system_notes(args):
    """The systems lines of the report."""
    return ["systems: plain = model.fit; remat-<mode> = the model built under "
            "keras.RematScope(mode=<mode>) (list_of_layers: the model's blocks, or its "
            "convolutions where it has none); recompute-blocks = tf.recompute_grad around each "
            "block; tfmem = tfmem.keras.partitioned(model, **" + repr(tfmem_options(args))
            + ") (partition_size auto: budget mode, the emulated cap as the budget unless "
            "--budget); tfmem+remat-activations = both",
            "every trial: Adam (1e-3), sparse categorical cross-entropy, jit_compile=False, "
            f"{args.steps} steps of one seeded batch (one epoch each), more (at most "
            f"{EXTRA_STEPS}) until {STEADY_STEPS} follow tfmem's last change of plan"]


# --------------------------------------------------------------------------
# one trial, in this process


def error_text(err):
    """An exception in one line: Keras's "Exception encountered when calling X" with the
    message under it (ANSI bold stripped), else common's first line."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(err).splitlines()]
    lines = [line for line in lines if line]
    if lines and lines[0].startswith("Exception encountered when calling") and len(lines) > 1:
        return f"{type(err).__name__}: {lines[0]} {lines[1]}"
    return f"{type(err).__name__}: {first_line(err)}"


# Ops whose outputs are their inputs (no memory of their own), and ops that only read or
# write variables: not an op working set.
NOT_WORKING_SETS = frozenset({"Identity", "IdentityN", "StopGradient", "NoOp", "ReadVariableOp",
                              "AssignVariableOp", "Placeholder", "Const"})


def _working_sets(tf, concrete):
    """(largest op's inputs + outputs in bytes, its name and type) of a traced step, from the
    static shapes (tensors of unknown size, resources and variants not counted; nor ops that
    forward their inputs, NOT_WORKING_SETS)."""
    best = (0, None, None)
    for op in concrete.graph.get_operations():
        if op.type in NOT_WORKING_SETS:
            continue
        total = 0
        for tensor in list(op.inputs) + list(op.outputs):
            if tensor.dtype in (tf.resource, tf.variant) or not tensor.shape.is_fully_defined():
                continue
            total += tensor.shape.num_elements() * tensor.dtype.size
        if total > best[0]:
            best = (total, op.name, op.type)
    return best


def enough_steps(step_times, partitions, steps):
    """Whether a trial may stop: `steps` steps run, and STEADY_STEPS after the last change of
    plan (fewer only where `steps` leaves no room for them)."""
    wanted = min(STEADY_STEPS, steps - 1)
    return len(step_times) >= steps and len(steady_times(step_times, partitions)) >= wanted


def steady_times(step_times, partitions):
    """The step times after the first step and after the last step whose plan (its partition
    count; None for a plain system) differed from the step before it."""
    start = 1
    for index in range(1, len(partitions)):
        if partitions[index] != partitions[index - 1]:
            start = index + 1
    return step_times[start:]


def tfmem_options(args):
    """tfmem.keras.partitioned's keyword arguments for the trial settings in `args`."""
    options = dict(partition_size=args.partition_size, swap=args.swap,
                   swap_distance=args.swap_distance, prefetch=args.prefetch)
    if args.swap_min_bytes is not None:
        options["swap_min_bytes"] = args.swap_min_bytes
    if args.budget is not None:
        options["device_memory_budget"] = args.budget * MIB
    return options


def run_keras_trial(experiment, args):
    """Build the model for one system and size, fit one-batch epochs (enough_steps); a dict."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import keras  # pylint: disable=import-outside-toplevel

    import tfmem  # pylint: disable=import-outside-toplevel
    from tfmem.cli import child_env  # pylint: disable=import-outside-toplevel
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    if args.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    if args.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    system = args.system[0]
    limit = accelerator.emulated_memory_mib()
    result = dict(experiment=experiment.name, system=system, size_name=experiment.size,
                  size=args.size, index=experiment.index_of(args.size),
                  batch_size=args.batch_size, steps=args.steps,
                  device_memory_mib=None if limit == child_env.MEASURE_LIMIT_MIB else limit,
                  allocator_limit_mib=limit,
                  kernel_path=child_env.kernel_path(child_env.onednn_from_env()),
                  model={name: getattr(args, name) for name in experiment.model_args},
                  status=None, ok=False, error=None, parameters=None, state_bytes=None,
                  state=None, step_times=[], losses=[], throughput=None, peak_bytes=None,
                  step_peaks=[], step_partitions=[], steady_step_times=[],
                  seconds_per_sample=None, largest_op_bytes=None, largest_op=None,
                  scratch_bytes=None, build_seconds=None, first_step_seconds=None,
                  seconds=None, remat_mode=remat_mode(system), tfmem=None)
    report_phase("building", started)
    phase = "building"
    try:
        mode = remat_mode(system)
        recompute = system == "recompute-blocks"
        if mode is not None:
            names = experiment.remat_layer_names if mode == "list_of_layers" else None
            with keras.RematScope(mode=mode, layer_names=names(args) if names else None):
                model = experiment.build(args.size, args, recompute)
        else:
            model = experiment.build(args.size, args, recompute)
        x, y = experiment.data(args.size, args)
        result["batch_size"] = len(x)
        result["parameters"] = int(model.count_params())
        step = None
        if is_tfmem(system):
            options = tfmem_options(args)
            tfmem.keras.partitioned(model, **options)
            result["tfmem"] = dict(options, budget_mib=args.budget or (
                result["device_memory_mib"] if args.partition_size == "auto" else None))
        result["build_seconds"] = time.perf_counter() - started

        class Measure(keras.callbacks.Callback):
            """Per step: the allocator's peak from the step's start, its time and loss."""

            def on_train_batch_begin(self, batch, logs=None):
                report_phase(f"step {len(result['step_times'])}", started)
                accelerator.reset_peak("CPU:0")
                self.began = time.perf_counter()  # pylint: disable=attribute-defined-outside-init

            def on_train_batch_end(self, batch, logs=None):
                result["step_times"].append(time.perf_counter() - self.began)
                memory = accelerator.device_memory("CPU:0")
                result["step_peaks"].append(memory["peak"] if memory else None)
                result["losses"].append(float(logs["loss"]))
                last = tfmem.keras.train_step_of(self.model)
                result["step_partitions"].append(
                    last.last_step.partitions if last is not None and last.last_step else None)

            def on_epoch_end(self, epoch, logs=None):
                # Budget mode may plan again after a measured step: time steps after it.
                if enough_steps(result["step_times"], result["step_partitions"], args.steps):
                    self.model.stop_training = True

        phase = "training"
        model.fit(x, y, batch_size=len(x), epochs=args.steps + EXTRA_STEPS, shuffle=False,
                  verbose=0, callbacks=[Measure()])
        result["status"], result["ok"] = "ok", True
    except tf.errors.ResourceExhaustedError as err:  # tfmem's DeviceMemoryError is one too
        result["status"] = "oom"
        result["error"] = f"{type(err).__name__}: {first_line(err.message)}"
    except tfmem.BudgetError as err:
        result["status"], result["error"] = "budget", str(err)
    except tfmem.HostMemoryError as err:
        result["status"], result["error"] = "host-memory", str(err)
    except Exception as err:  # pylint: disable=broad-except
        # A Keras rematerialisation mode that cannot run this model is a result; anything
        # else (tfmem refusing the model included) is a failure of the run.
        result["status"] = "unsupported" if remat_mode(system) and not is_tfmem(
            system) else "error"
        result["error"] = error_text(err)
    if not result["ok"]:
        result["failed_in"] = f"{phase} (step {len(result['step_times'])})"
    peaks = [p for p in result["step_peaks"] if p]
    memory = accelerator.device_memory("CPU:0")
    if not result["ok"] and memory:  # the step that failed counts too
        peaks.append(memory["peak"])
    result["peak_bytes"] = max(peaks) if peaks else None
    times = result["step_times"]
    if times:
        result["first_step_seconds"] = times[0]
        partitions = result["step_partitions"]
        planned = [True] + [now != before for before, now in zip(partitions, partitions[1:])]
        result.update(steady_figures.split(times, planned, steady_steps=STEADY_STEPS))
        steady = steady_times(times, partitions)
        result["steady_step_times"] = steady
        if steady:
            result["seconds_per_sample"] = statistics.median(steady) / result["batch_size"]
            result["throughput"] = 1.0 / result["seconds_per_sample"]
    if result["ok"]:
        state = keras_models.state_bytes(model)
        result["state"], result["state_bytes"] = state, state["total"]
        step = tfmem.keras.train_step_of(model)
        if step is not None:
            report = step.memory_report()
            result["tfmem"].update(
                partitions=step.last_step.partitions,
                swapped_out_bytes=step.last_step.swapped_out_bytes,
                host_buffer_bytes=step.last_step.host_buffer_bytes,
                predicted_peak_bytes=report.predicted_device_peak,
                last_step=str(step.last_step))
            result["scratch_bytes"] = max(report.partition_scratch or (0,))
        # The same train step traced once more (no step runs): its ops' static sizes.
        concrete = tf.function(model.train_step).get_concrete_function(
            (tf.TensorSpec(x.shape, x.dtype), tf.TensorSpec(y.shape, y.dtype)))
        largest, name, kind = _working_sets(tf, concrete)
        result["largest_op_bytes"], result["largest_op"] = largest, f"{name} ({kind})"
    result["seconds"] = time.perf_counter() - started
    report_phase("done", started)
    return result


# --------------------------------------------------------------------------
# the report: each system beside plain fit


def _trial_at(summary, size):
    for trial in summary["all_trials"]:
        if trial.get("size") == size and trial.get("ok"):
            return trial
    return None


def _best(summary):
    return _trial_at(summary, summary["max_size"]) if summary["max_size"] else None


def _mib(value):
    return None if value is None else round(value / MIB, 1)


def comparison(summaries, cap_mib=None):
    """Per system: its limit beside plain fit's (rows of dicts)."""
    by_system = {s["system"]: s for s in summaries}
    plain = by_system.get(BASELINE)
    plain_best = _best(plain) if plain else None
    rows = []
    for summary in summaries:
        best = _best(summary)
        row = dict(system=summary["system"], max_size=summary["max_size"],
                   ratio=(round(summary["max_size"] / plain["max_size"], 2)
                          if plain and plain["max_size"] and summary["max_size"] else None),
                   first_step_seconds=summary["first_step_seconds"],
                   seconds_per_sample=None, time_ratio=None, losses_size=None,
                   losses_equal=None, max_loss_difference=None, state_mib=None,
                   state_share=None, largest_op_mib=None, largest_op=None, scratch_mib=None,
                   peak_mib=summary["peak_mib"], limit=summary["limit_text"],
                   failure=summary["failure"])
        if best:
            row["seconds_per_sample"] = best.get("seconds_per_sample")
            if plain_best and plain_best.get("seconds_per_sample") and best.get(
                    "seconds_per_sample"):
                row["time_ratio"] = round(best["seconds_per_sample"]
                                          / plain_best["seconds_per_sample"], 2)
            row.update(state_mib=_mib(best.get("state_bytes")),
                       largest_op_mib=_mib(best.get("largest_op_bytes")),
                       largest_op=best.get("largest_op"),
                       scratch_mib=_mib(best.get("scratch_bytes")))
            if cap_mib and best.get("state_bytes"):
                row["state_share"] = round(best["state_bytes"] / MIB / cap_mib, 2)
        # Losses at the largest size both this system and plain fit trained.
        if plain is not None:
            shared = sorted({t["size"] for t in summary["all_trials"] if t.get("ok")}
                            & {t["size"] for t in plain["all_trials"] if t.get("ok")})
            if shared:
                mine, theirs = _trial_at(summary, shared[-1]), _trial_at(plain, shared[-1])
                count = min(len(mine["losses"]), len(theirs["losses"]))
                differences = [abs(a - b) for a, b in zip(mine["losses"][:count],
                                                          theirs["losses"][:count])]
                row.update(losses_size=shared[-1], losses_equal=not any(differences),
                           max_loss_difference=max(differences) if differences else None)
        rows.append(row)
    return rows


def comparison_markdown(rows, size_name):
    head = ["system", f"max {size_name}", "x plain", "first step s", "s per sample",
            "x plain's s per sample", f"losses = plain at {size_name}", "state MiB",
            "state / cap", "largest op MiB", "kernel scratch MiB", "peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row["losses_size"] is None:
            losses = "-"
        elif row["losses_equal"]:
            losses = f"{row['losses_size']}: equal"
        else:
            losses = f"{row['losses_size']}: differ by {row['max_loss_difference']:.2g}"
        cells = [row["system"], row["max_size"], row["ratio"], row["first_step_seconds"],
                 None if row["seconds_per_sample"] is None else f"{row['seconds_per_sample']:.4f}",
                 row["time_ratio"], losses, row["state_mib"], row["state_share"],
                 row["largest_op_mib"], row["scratch_mib"], row["peak_mib"]]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines)


def check_losses(experiment, args, summaries, out=None):
    """A trial at plain fit's largest size for every system that trained but never at a size
    plain fit trained (the search starts later systems at the largest size so far), so that
    its losses can be set beside plain's; added to the system's trials."""
    plain = {s["system"]: s for s in summaries}.get(BASELINE)
    if plain is None or not plain["max_size"]:
        return
    trained = {t["size"] for t in plain["all_trials"] if t.get("ok")}
    for summary in summaries:
        if not summary["max_size"] or any(t.get("ok") and t["size"] in trained
                                          for t in summary["all_trials"]):
            continue
        trial = spawn_trial(experiment, args, summary["system"], plain["max_size"],
                                   args.trial_timeout)
        trial["losses_check"] = True
        summary["all_trials"].append(trial)
        if out:
            out(f"losses: {describe_trial(trial)}")


def report(args, summaries, stem, out=None, experiment=None):  # pylint: disable=unused-argument
    """The table that sets every system beside plain fit (Extra); with `experiment`,
    first the trials check_losses needs."""
    if experiment is not None:
        check_losses(experiment, args, summaries, out)
    rows = comparison(summaries, args.device_memory)
    size_name = summaries[0]["size_name"] if summaries else "size"
    notes = [
        f"s per sample: the median of the steps after the first (and, for tfmem, after its "
        f"last change of plan) at the system's largest {size_name}; x plain's: against plain "
        f"fit's at plain's largest",
        f"losses: the per-step losses of the largest {size_name} both the system and plain fit "
        "trained (a system whose search started above plain's largest gets one more trial "
        "there), compared exactly",
        "state: weights + gradients + optimizer slots; largest op: the largest inputs + "
        "outputs of one op in the traced train step (static shapes); kernel scratch: tfmem's "
        "measured largest per partition (tfmem systems only)"]
    fraction = getattr(args, "state_fraction", None)
    if fraction:
        probes = ", ".join(f"{p['size']}: " + (f"{p['share']:.2f}" if p["share"] else p["status"])
                           for p in getattr(args, "state_probes", []))
        notes.append(f"setting: state at most {fraction:g} of plain fit's peak at the cap's "
                     f"base {size_name} {args.cap_base} (state / plain peak per base tried: "
                     f"{probes})")
    else:
        notes.append("setting: the cap's base size as given; state / cap is in the table")
    markdown = "\n".join([f"**Against plain fit (cap {args.device_memory} MiB)**", "",
                          comparison_markdown(rows, size_name), ""]
                         + [f"- {note}" for note in notes]
                         + [f"- {row['system']}: largest op {row['largest_op']}"
                            for row in rows if row["largest_op"]])
    return Extra(markdown=markdown, data=dict(comparison=rows))


# --------------------------------------------------------------------------
# the setting: how much of the cap the state fills


STATE_PROBES = 6  # doublings of the base size tried for --state-fraction


def add_setting_arguments(group):
    group.add_argument("--state-fraction", type=float, metavar="F",
                       help="without --device-memory: double --cap-base until the state "
                            "(weights, gradients, optimizer slots) is at most F of plain fit's "
                            "peak there, then derive the cap at that size (0.1: state a tenth "
                            "of the cap, as on the GPUs of the papers; 0.33: a third)")


def choose_cap_base(experiment, args, out=None):
    """--state-fraction: the smallest base size (--cap-base doubled) at which the state is at
    most that fraction of plain fit's peak; args.cap_base moves there, args.state_probes
    records the trials."""
    fraction = getattr(args, "state_fraction", None)
    args.state_probes = []
    if not fraction:
        return
    uncapped = argparse.Namespace(**vars(args))
    uncapped.device_memory = None
    index = experiment.index_of(args.cap_base)
    for _ in range(STATE_PROBES):
        size = experiment.sizes(index)
        trial = spawn_trial(experiment, uncapped, BASELINE, size, args.trial_timeout)
        share = (trial["state_bytes"] / trial["peak_bytes"]
                 if trial.get("ok") and trial.get("peak_bytes") else None)
        args.state_probes.append(dict(size=size, share=share, status=trial.get("status")))
        if out:
            out(f"state fraction: plain fit at {experiment.size}={size}: "
                + (f"state {share:.2f} of its peak" if share else describe_trial(trial)))
        if share is None or share <= fraction:
            break
        index *= 2
    args.cap_base = size


# --------------------------------------------------------------------------
# an experiment


def experiment(*, name, title, size, size_help, sizes, index_of, build, data, script,
               add_arguments, model_args, defaults, quick, unit, blocks=True,
               remat_layer_names=None):
    """A Experiment of Keras systems.

    build(size, args, recompute_blocks) -> compiled Keras model; data(size, args) -> (x, y);
    remat_layer_names(args) -> the layer names keras.RematScope(mode="list_of_layers") gets.
    """
    def arguments(group):
        add_arguments(group)
        add_setting_arguments(group)

    exp = Experiment(
        name=name, title=title, size=size, size_help=size_help, sizes=sizes, index_of=index_of,
        build=build, script=script, add_arguments=arguments, model_args=model_args,
        defaults=defaults, quick=quick, unit=unit, systems=systems(blocks),
        labels=dict(LABELS), baseline=BASELINE, trial=run_keras_trial,
        system_notes=system_notes, choose_cap_base=choose_cap_base)
    exp.data = data
    exp.report = functools.partial(report, experiment=exp)
    exp.remat_layer_names = remat_layer_names
    return exp
