"""One trial in this process: build the model, train it with one system until the
steady state is measured, and describe the outcome.

The cap must be set before TensorFlow starts (harness.main does it); TensorFlow is
imported inside run_trial only.
"""

import os
import sys
import time

import tfmem
from tfmem.cli import child_env
from tfmem.run.front_end.options import split_settings

from experiments.harness import steady
from experiments.harness.experiment import GRAPPLER_MEMORY_OPTIMIZATION, MIB, is_size_limit
from experiments.harness.options import tfmem_settings

def session_config(tf, system, inter_op_threads=0, intra_op_threads=0, kind="default"):
    """The ConfigProto of a system's session: TensorFlow's defaults (kind "default") or
    tfmem.session_config()'s (kind "tfmem": Grappler's meta optimizer off, for every
    system alike), plus Grappler's memory optimizer for `grappler` (which does not run
    under "tfmem")."""
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=inter_op_threads,
                                      intra_op_parallelism_threads=intra_op_threads)
    if kind == "tfmem":
        config = tfmem.session_config(config)
    if system == "grappler":
        from tensorflow.core.protobuf import rewriter_config_pb2  # pylint: disable=import-outside-toplevel
        config.graph_options.rewrite_options.memory_optimization = getattr(
            rewriter_config_pb2.RewriterConfig, GRAPPLER_MEMORY_OPTIMIZATION)
    return config


def size_limit(err, tf):
    """(status, error text) of a trial's exception that says the size does not fit: the
    device ran out ("oom"; tfmem's DeviceMemoryError is one), budget mode found no plan
    ("budget") or the host cannot hold the swapped tensors ("host-memory"); else None."""
    if isinstance(err, tf.errors.ResourceExhaustedError):
        return "oom", f"{type(err).__name__}: {first_line(err.message)}"
    if isinstance(err, tfmem.BudgetError):
        return "budget", str(err)
    if isinstance(err, tfmem.HostMemoryError):
        return "host-memory", str(err)
    return None


def first_line(message):
    """The line of an error message that says what failed (an OOM's shape, not its device)."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("OOM when allocating"):
            return line.split(" on /job")[0]
    return lines[0][:300] if lines else ""


PHASE = "PHASE"  # stderr marker of a trial's progress, read back when it times out or crashes


def report_phase(name, started):
    """Say on stderr which phase a trial entered, and when (read back by child.spawn_trial)."""
    print(f"{PHASE} {name} {time.perf_counter() - started:.1f}", file=sys.stderr, flush=True)


def run_trial(experiment, args):
    """Build and train one size with one system in this process; the result dict.

    The cap must already be set (main does it before importing TensorFlow).
    Progress goes to stderr as PHASE lines, so that a parent that has to kill
    the trial (time limit) or sees it crash can tell how far it got.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    started = time.perf_counter()
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from tfmem.run.placement import accelerator  # pylint: disable=import-outside-toplevel

    if args.allocator == "one-region":
        tfmem.reserve_emulated_memory()
    system = args.system[0]
    limit = accelerator.emulated_memory_mib()
    result = dict(experiment=experiment.name, system=system, size_name=experiment.size,
                  size=args.size, index=experiment.index_of(args.size),
                  batch_size=args.batch_size, steps=None,
                  device_memory_mib=None if limit == child_env.MEASURE_LIMIT_MIB else limit,
                  allocator_limit_mib=limit,
                  kernel_path=child_env.kernel_path(child_env.onednn_from_env()),
                  model={name: getattr(args, name) for name in experiment.model_args},
                  status=None, ok=False, error=None, parameters=None, state_bytes=None,
                  step_times=[], losses=[], throughput=None, peak_bytes=None, step_peaks=[],
                  resident_after_init_bytes=None, resident_after_steps_bytes=None,
                  build_seconds=None, first_step_seconds=None, seconds=None,
                  replans=None, replan_steps=None, recompiles=None, steady_step_count=None,
                  steady_seconds=None, steady_ms_per_unit=None, work_unit=experiment.work_unit,
                  grappler=GRAPPLER_MEMORY_OPTIMIZATION if system == "grappler" else None,
                  session_config=args.session_config, allocator=args.allocator,
                  tfmem=None)
    report_phase("building", started)
    model = experiment.build(tf, args.size, args)
    result["parameters"] = model.parameters
    with model.graph.as_default():
        result["state_bytes"] = sum(
            v.shape.num_elements() * v.dtype.size for v in tf.compat.v1.global_variables())
    result["build_seconds"] = time.perf_counter() - started
    sess = tf.compat.v1.Session(graph=model.graph,
                                config=session_config(tf, system, args.inter_op_threads,
                                                       args.intra_op_threads,
                                                       args.session_config))
    runner = sess
    if system == "tfmem":
        settings = tfmem_settings(args)
        if args.budget is not None:
            settings["device_memory_budget"] = args.budget * MIB
        everyday, options = split_settings(settings)
        runner = tfmem.TFMemSession(sess, **everyday, options=options)
        budget = args.budget if args.budget is not None else (
            result["device_memory_mib"] if args.partition_size == "auto" else None)
        result["tfmem"] = dict(settings, budget_mib=budget, step_paths=[])
    peak, phase = 0, "initialising"
    try:
        report_phase(phase, started)
        # Each system initialises its variables as its user would: through the session it
        # runs steps with.  tfmem then releases the initializer's executor, and with it
        # the zeros and ones TensorFlow would keep beside the variables (first_updates).
        runner.run(model.init)
        # which steps of the training request plan it (again): tfmem's re-plans
        watch = steady.ReplanWatch(runner) if system == "tfmem" else None
        planned = []  # per step: did it begin by planning?
        memory = accelerator.device_memory("CPU:0")
        result["resident_after_init_bytes"] = memory["current"] if memory else None
        accelerator.reset_peak("CPU:0")
        step = 0
        while not steady.done(planned, args.steps, args.max_steps, args.steady_steps):
            phase = f"step {step}"
            report_phase(phase, started)
            step_started = time.perf_counter()
            try:
                _, loss = runner.run([model.train_op, model.loss], feed_dict=model.feed)
            finally:
                memory = accelerator.device_memory("CPU:0")
                if memory is not None:
                    peak = max(peak, memory["peak"])
            result["step_times"].append(time.perf_counter() - step_started)
            if system == "tfmem":  # which path the step took (see --partial-runs)
                result["tfmem"]["step_paths"].append(
                    "partial run" if runner.last_step.partial_run else "callables")
            result["losses"].append(float(loss))
            result["step_peaks"].append(memory["peak"] if memory else None)
            result["resident_after_steps_bytes"] = memory["current"] if memory else None
            # plain TensorFlow: only its first step sets the request up
            planned.append(watch.planned[step] if watch and len(watch.planned) > step
                           else step == 0)
            step += 1
        result["status"], result["ok"] = "ok", True
    except Exception as err:  # pylint: disable=broad-except
        # Anything but "does not fit" is a bug or a broken setup.  The search reports it
        # as a failure of the run (is_size_limit), never as a size limit.
        result["status"], result["error"] = size_limit(err, tf) or (
            "error", f"{type(err).__name__}: {first_line(err)}")
    if not result["ok"]:
        result["failed_in"] = phase
    result["peak_bytes"] = peak or None
    times = result["step_times"]
    result["steps"] = len(times)
    result.update(steady.split(times, planned, watch.compiled if watch else None,
                               args.steady_steps))
    result["steady_ms_per_unit"] = steady.ms_per_unit(result["steady_seconds"], args.size,
                                                      model.examples)
    if result["steady_seconds"]:
        result["throughput"] = model.examples / result["steady_seconds"]
    if system == "tfmem" and runner.last_step is not None:
        stats = runner.last_step
        info = result["tfmem"]
        info.update(partitions=stats.partitions, swapped_out_bytes=stats.swapped_out_bytes,
                    host_buffer_bytes=stats.host_buffer_bytes, host_rss_bytes=stats.host_rss_bytes,
                    prefetch_wait_seconds=stats.prefetch_wait_time, last_step=str(stats),
                    last_compile=str(runner.last_compile) if runner.last_compile else None)
        if result["ok"]:
            plan = runner.plan([model.train_op, model.loss], feed_dict=model.feed)
            report = runner.memory_report()
            info.update(plan_partition_size=plan.partition_size,
                        predicted_peak_bytes=report.predicted_device_peak)
    if system == "tfmem":
        runner.close()
    else:
        sess.close()
    result["seconds"] = time.perf_counter() - started
    report_phase("done", started)
    return result


def describe_trial(result):
    """One line about a trial, for people (with the trial's own time when known)."""
    size = f"{result['size_name']}={result['size']}"
    seconds = result.get("process_seconds") or result.get("seconds")
    took = f" [{seconds:.0f} s]" if seconds else ""
    if result.get("ok"):
        peak = result.get("peak_bytes")
        text = f"{result['system']} {size}: trained {len(result['step_times'])} steps"
        if result.get("first_step_seconds") is not None:
            text += f", first {result['first_step_seconds']:.2f} s"
        if result.get("replans"):
            text += f", {result['replans']} re-plans"
        text += (f", steady {result['steady_seconds']:.3f} s" if result.get("steady_seconds")
                 else ", steady state not measured" if "steady_seconds" in result
                 else f", {result['throughput']:.2f} {result.get('unit', 'examples')}/s"
                 if result.get("throughput") else ", no step after the first timed")
        text += f", peak {peak / MIB:.1f} MiB" if peak else ""
        info = result.get("tfmem") or {}
        if info.get("partitions"):
            text += (f", {info['partitions']} partitions, "
                     f"{info['swapped_out_bytes'] / MIB:.0f} MiB swapped out")
        return text + took
    kind = result.get("status")
    if kind and not is_size_limit(result):
        kind = f"FAILURE ({kind})"
    return f"{result['system']} {size}: {kind} {result.get('error') or ''}".strip() + took
