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
import math
import os
import re
import statistics
import time

from tfmem.errors import failed_tensor

from experiments.harness import cap, steady as steady_figures
from experiments.harness.child import spawn_trial
from experiments.harness.experiment import MIB, Experiment, Extra, is_tfmem
from experiments.harness.reports import cell
from experiments.harness.trial import describe_trial, first_line, report_phase, size_limit

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


# tfmem's BudgetError (tfmem/memory/budget.py) states its plan figures in its message only.
_BUDGET_FIGURES = re.compile(
    r"budget of (?P<budget>[\d.]+) MiB \(predictions must stay under (?P<limit>[\d.]+) MiB"
    r"(?:, after (?P<held>[\d.]+) MiB the device holds [^:]*?)?\): even one op "
    r"per partition needs (?P<needs>[\d.]+) MiB.*?The largest op, '(?P<op>[^']*)' "
    r"\((?P<kind>\w+)\), alone reads, writes and needs as scratch (?P<op_mib>[\d.]+) MiB", re.S)
_DTYPE_BYTES = {"float": 4, "double": 8, "half": 2, "int32": 4, "int64": 8, "bfloat16": 2}


def budget_figures(message):
    """The plan figures of tfmem's "nothing fits the budget" error, in MiB: the budget, the
    limit predictions must stay under, what the device already held (the state), what one op
    per partition needs, and the largest op (reads + writes + kernel scratch); or None."""
    match = _BUDGET_FIGURES.search(message or "")
    if match is None:
        return None
    return dict(budget_mib=float(match["budget"]), limit_mib=float(match["limit"]),
                allocator_refused="cannot serve its requests" in message,
                held_mib=float(match["held"] or 0.0), one_op_mib=float(match["needs"]),
                largest_op_mib=float(match["op_mib"]),
                largest_op=f"{match['op']} ({match['kind']})")


def failed_allocation(message):
    """(MiB, shape text) of the tensor TensorFlow's OOM error could not allocate, or None."""
    failed = failed_tensor(message)
    if failed is None or failed[1] not in _DTYPE_BYTES:
        return None
    shape, dtype = failed
    size = _DTYPE_BYTES[dtype] * math.prod(shape)
    return round(size / MIB, 1), f"[{','.join(map(str, shape))}] {dtype}"


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
    from tfmem.run.front_end.options import split_settings  # pylint: disable=import-outside-toplevel
    from tfmem.cli import child_env  # pylint: disable=import-outside-toplevel
    from tfmem.cli import keras_models  # pylint: disable=import-outside-toplevel
    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    if args.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    if args.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    # the cap as one region, as a GPU's allocator holds it (this starts TensorFlow's context)
    reserved = tfmem.reserve_emulated_memory() if args.allocator == "one-region" else None
    system = args.system[0]
    limit = accelerator.emulated_memory_mib()
    result = dict(experiment=experiment.name, system=system, size_name=experiment.size,
                  size=args.size, index=experiment.index_of(args.size),
                  batch_size=args.batch_size, steps=args.steps,
                  device_memory_mib=None if limit == child_env.MEASURE_LIMIT_MIB else limit,
                  allocator_limit_mib=limit, allocator=args.allocator,
                  reserved_region_bytes=reserved,
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
            everyday, rest = split_settings(options)
            tfmem.keras.partitioned(model, **everyday, options=rest)
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
    except Exception as err:  # pylint: disable=broad-except
        # A Keras rematerialisation mode that cannot run this model is a result; anything
        # else but a size limit (tfmem refusing the model included) is a failure of the run.
        limit = size_limit(err, tf)
        if limit is not None:
            result["status"], result["error"] = limit
            if limit[0] == "budget":
                result["budget_figures"] = budget_figures(str(err))
        else:
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
                resident_bytes=report.device_resident,
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


def predicted_peak(report):
    """The bytes tfmem predicted TensorFlow's peak at: the plan's peak (the step's own
    tensors) plus what the device held when the step started (the model's variables,
    the batch), as TensorFlow's peak counts them; the plan's alone where the trial did not
    record what was held; None without a prediction."""
    predicted = report.get("predicted_peak_bytes")
    if predicted is None:
        return None
    return predicted + (report.get("resident_bytes") or 0)


def _failed_trial(summary):
    size = summary.get("first_failing_size")
    for trial in summary["all_trials"]:
        if trial.get("size") == size and not trial.get("ok"):
            return trial
    return None


def what_stopped(trial):
    """What filled the device in a system's first failing trial, in MiB, from tfmem's plan
    figures (its budget error) or TensorFlow's OOM error; None when it says neither."""
    if trial is None:
        return None
    figures = budget_figures(trial.get("error")) or trial.get("budget_figures")
    if figures:
        refused = (", and the allocator cannot serve its requests within the cap less the "
                   "margin"
                   if figures.get("allocator_refused") else "")
        return (f"{trial['size']}: one op per partition needs {figures['one_op_mib']:g} MiB "
                f"of {figures['limit_mib']:g} MiB allowed{refused} ({figures['held_mib']:g} "
                f"MiB held between steps: variables); largest op "
                f"{figures['largest_op_mib']:g} MiB (reads + writes + kernel scratch)")
    allocation = failed_allocation(trial.get("error"))
    if allocation:
        return f"{trial['size']}: OOM allocating {allocation[1]} ({allocation[0]:g} MiB)"
    return None


def comparison(summaries, cap_mib=None, state_share=None):
    """Per system: its limit beside plain fit's (rows of dicts)."""
    by_system = {s["system"]: s for s in summaries}
    plain = by_system.get(BASELINE)
    plain_best = _best(plain) if plain else None
    rows = []
    for summary in summaries:
        best = _best(summary)
        failed = _failed_trial(summary)
        row = dict(system=summary["system"], setting=state_share, max_size=summary["max_size"],
                   ratio=(round(summary["max_size"] / plain["max_size"], 2)
                          if plain and plain["max_size"] and summary["max_size"] else None),
                   first_step_seconds=summary["first_step_seconds"],
                   replans=summary.get("replans"), first_failing_size=failed and failed["size"],
                   stopped_by=what_stopped(failed),
                   budget_figures=(failed or {}).get("budget_figures"),
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
            row["predicted_peak_mib"] = _mib(predicted_peak(best.get("tfmem") or {}))
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
    head = ["system", "state share", f"max {size_name}", "x plain", "first step s", "re-plans",
            "s per sample", "x plain's s per sample", f"losses = plain at {size_name}",
            "state MiB", "state / cap", "largest op MiB", "kernel scratch MiB",
            "tfmem predicted peak MiB", "peak MiB", f"what stopped it (first failing {size_name})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if row["losses_size"] is None:
            losses = "-"
        elif row["losses_equal"]:
            losses = f"{row['losses_size']}: equal"
        else:
            losses = f"{row['losses_size']}: differ by {row['max_loss_difference']:.2g}"
        cells = [row["system"], row.get("setting"), row["max_size"], row["ratio"],
                 row["first_step_seconds"], row.get("replans"),
                 None if row["seconds_per_sample"] is None else f"{row['seconds_per_sample']:.4f}",
                 row["time_ratio"], losses, row["state_mib"], row["state_share"],
                 row["largest_op_mib"], row["scratch_mib"], row.get("predicted_peak_mib"),
                 row["peak_mib"], row.get("stopped_by") or row.get("limit")]
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
    rows = comparison(summaries, args.device_memory, getattr(args, "state_share", None))
    size_name = summaries[0]["size_name"] if summaries else "size"
    notes = [
        f"s per sample: the median of the steps after the first (and, for tfmem, after its "
        f"last change of plan) at the system's largest {size_name}; x plain's: against plain "
        f"fit's at plain's largest; re-plans: steps after the first whose plan had another "
        f"partition count (what tfmem.keras's step statistics show of a re-plan)",
        f"losses: the per-step losses of the largest {size_name} both the system and plain fit "
        "trained (a system whose search started above plain's largest gets one more trial "
        "there), compared exactly",
        f"at the system's largest {size_name}: state = weights + gradients + optimizer slots "
        "(the model's variables); largest op: the largest inputs + outputs of one op in the "
        "traced train step (static shapes); kernel scratch: the largest of any partition and "
        "tfmem predicted peak: the plan's, from tfmem's memory report, plus what the device "
        "held when the step started (variables, the batch), as TensorFlow's peak counts them "
        "(tfmem systems only; a trial that did not record what was held: the plan's alone); "
        "peak: TensorFlow's allocator",
        f"what stopped it, at the first {size_name} that failed: for tfmem the figures of its "
        "plan (budget mode's error: what one op per partition needs against what the "
        "budget allows beside what the device holds between steps, and the largest op's "
        "reads, writes and kernel scratch); for the others the tensor TensorFlow could not "
        "allocate"]
    share = getattr(args, "state_share", None)
    notes.append(f"setting: state {share:g} of the cap (--state-share: the cap is the state "
                 "divided by it)" if share else
                 "setting: the cap from plain fit's peak at the cap's base size (or given); "
                 "state / cap is in the table")
    markdown = "\n".join([f"**Against plain fit (cap {args.device_memory} MiB)**", "",
                          comparison_markdown(rows, size_name), ""]
                         + [f"- {note}" for note in notes]
                         + [f"- {row['system']}: largest op {row['largest_op']}"
                            for row in rows if row["largest_op"]])
    return Extra(markdown=markdown, data=dict(comparison=rows))


def stored_report(data):
    """report()'s markdown rebuilt from a result file's JSON (its settings and summaries,
    every trial included): the table follows this module, not the code that ran."""
    args = argparse.Namespace(**data["settings"])
    return report(args, data["summaries"], None).markdown


# --------------------------------------------------------------------------
# the setting: how much of the cap the state fills


STATE_SHARES = (0.1, 0.33)  # the papers' GPUs (state a tenth of 16 GB), and a third


def add_setting_arguments(group):
    group.add_argument("--state-share", type=float, choices=STATE_SHARES, metavar="S",
                       help="without --device-memory: the cap is the state (weights, "
                            "gradients, optimizer slots) plain fit holds at --cap-base "
                            "divided by S, so that the state fills S of the device (0.1: as on "
                            "the GPUs of the papers; 0.33: a third)")


def derive_cap(experiment, args, out=None):
    """The cap of a search: harness.cap.derive_cap (plain fit's peak at --cap-base), and with
    --state-share S the state those trials measured divided by S; the cap info records
    the state, the share, plain's peak and the rule."""
    info = cap.derive_cap(experiment, args, out)
    share = getattr(args, "state_share", None)
    info["state_share"] = share
    if not share or info["cap_mib"] is None:
        return info
    state = info["trial"].get("state_bytes")
    if not state:
        info.update(cap_mib=None, error=f"plain fit at {experiment.size}={args.cap_base} "
                                        "reported no state size")
        return info
    info["state_mib"] = round(state / MIB, 2)
    info["cap_mib"] = -(-int(state / share) // MIB)
    info["factor"] = round(info["cap_mib"] / info["plain_peak_mib"], 3)
    info["note"] = (f"{info['cap_mib']} MiB = the state plain fit holds at {experiment.size} "
                    f"{args.cap_base} ({info['state_mib']} MiB: weights, gradients, optimizer "
                    f"slots) / {share:g}, rounded up, so that the state fills {share:g} of it "
                    f"(plain fit's peak there: {cap.cap_peak_text(info)}, "
                    f"{info['kernel_path']}, BFC allocator without a cap)")
    if out:
        out(f"cap: {info['note']}")
    return info


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
        system_notes=system_notes, derive_cap=derive_cap)
    exp.data = data
    exp.report = functools.partial(report, experiment=exp)
    exp.remat_layer_names = remat_layer_names
    return exp
