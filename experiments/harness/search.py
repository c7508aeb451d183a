"""The max-size search: per system, exponential then binary search on the size knob,
one child process per trial, and the report row of each system's search."""

import time

from experiments.harness.child import Progress, spawn_trial
from experiments.harness.experiment import LIMITS, MIB, is_size_limit
from experiments.harness.trial import describe_trial

def find_max(trial, start, sizes, max_index=None, tolerance=0.0, max_trials=40,
             search_time=None, progress=None):
    """The largest search index whose trial succeeds: exponential, then binary search.

    trial(k) -> result dict with "ok".  Doubles k from `start` until a trial
    fails (or `max_index`), then bisects between the largest success and the
    smallest failure until they are adjacent, or within `tolerance` times the
    success.  A failing start bisects downwards.  Only a failure that
    `is_size_limit` bounds the size; any other failure stops the search at
    once (stopped "failure", the trial in `failure`).  Returns a dict: best
    (index or 0), failed_at (smallest index that did not fit, or None),
    trials (in order), stopped (why the search ended early, or None),
    failure, seconds.
    """
    started = time.perf_counter()
    trials, results = [], {}
    low, high, stopped, failure = 0, None, None, None

    def run(k):
        nonlocal low, high, stopped, failure
        result = trial(k)
        results[k] = result
        trials.append(result)
        if result.get("ok"):
            low = max(low, k)
        elif is_size_limit(result):
            high = k if high is None else min(high, k)
        else:
            stopped, failure = "failure", result
        if progress:
            bracket = f"[{sizes(low) if low else '-'}, {sizes(high) if high else '?'})"
            progress(len(trials), f"{describe_trial(result)}  bracket {bracket}")
        return result

    def out_of_budget():
        nonlocal stopped
        if stopped is not None:
            return True
        if len(trials) >= max_trials:
            stopped = "max-trials"
        elif search_time is not None and time.perf_counter() - started >= search_time:
            stopped = "search-time"
        return stopped is not None

    k = start if max_index is None else min(start, max_index)
    while not out_of_budget():
        if not run(k).get("ok"):
            break
        if max_index is not None and k >= max_index:
            stopped = "max-size"
            break
        k = k * 2 if max_index is None else min(k * 2, max_index)
    while high is not None and high - low > 1 and not out_of_budget():
        if low and high - low <= tolerance * low:
            break
        middle = (low + high) // 2
        run(middle)
    return dict(best=low, failed_at=high, trials=trials, stopped=stopped, failure=failure,
                seconds=time.perf_counter() - started)


def search_systems(experiment, args, out=None):
    """find_max for every requested system; a list of per-system summaries."""
    systems = args.system or list(experiment.systems)
    first = experiment.index_of(args.start) if args.start else 1
    max_index = experiment.index_of(args.max_size) if args.max_size else None
    summaries, best_so_far = [], 0
    for system in systems:
        start = max(first, best_so_far)
        bar = Progress(system, args.max_trials, args.search_time)
        outcome = find_max(
            lambda k, s=system: spawn_trial(experiment, args, s, experiment.sizes(k),
                                            args.trial_timeout),
            start, experiment.sizes, max_index=max_index, tolerance=args.tolerance,
            max_trials=args.max_trials, search_time=args.search_time, progress=bar.update)
        bar.close()
        summary = summarise(experiment, args, system, outcome)
        summaries.append(summary)
        best_so_far = max(best_so_far, outcome["best"])
        if out:
            out(format_summary(summary))
    return summaries


def summarise(experiment, args, system, outcome):
    """The report row of one system's search."""
    by_index = {t["index"]: t for t in outcome["trials"]}
    best = by_index.get(outcome["best"]) if outcome["best"] else None
    failed = by_index.get(outcome["failed_at"]) if outcome["failed_at"] else None
    failure = outcome.get("failure")
    if failure is not None:  # a failure of the run, not a limit: it says so first
        limit, failed = ("unsupported" if failure.get("status") == "unsupported"
                         else "error"), failure
    elif failed is not None:
        limit = failed["status"]
    else:
        limit = outcome["stopped"]
    info = (best or {}).get("tfmem") or {}
    return dict(
        experiment=experiment.name, system=system, label=experiment.labels[system],
        # The best trial's own batch where it has one (a Keras experiment whose size knob
        # is the batch), else the run's.
        batch_size=(best or {}).get("batch_size") or args.batch_size,
        device_memory_mib=args.device_memory,
        size_name=experiment.size, max_size=best["size"] if best else None,
        parameters=best["parameters"] if best else None,
        throughput=best["throughput"] if best else None, unit=experiment.unit,
        peak_mib=round(best["peak_bytes"] / MIB, 1) if best and best.get("peak_bytes") else None,
        state_mib=round(best["state_bytes"] / MIB, 1) if best and best.get("state_bytes") else None,
        resident_mib=(round(best["resident_after_steps_bytes"] / MIB, 1)
                      if best and best.get("resident_after_steps_bytes") else None),
        first_step_seconds=(round(best["first_step_seconds"], 1)
                            if best and best.get("first_step_seconds") is not None else None),
        replans=(best or {}).get("replans"),
        steady_step_count=(best or {}).get("steady_step_count"),
        steady_seconds=(best or {}).get("steady_seconds"),
        steady_ms_per_unit=(best or {}).get("steady_ms_per_unit"),
        work_unit=experiment.work_unit,
        first_failing_size=failed["size"] if failed else None,
        limit=limit, limit_text=LIMITS.get(limit, limit or ""),
        failure=(failed or {}).get("error"), run_failed=limit == "error",
        partitions=info.get("partitions"), swapped_out_mib=(
            round(info["swapped_out_bytes"] / MIB, 1) if info.get("swapped_out_bytes") is not None
            else None),
        trials=len(outcome["trials"]), search_seconds=round(outcome["seconds"], 1),
        stopped=outcome["stopped"], all_trials=outcome["trials"])


def format_summary(summary):
    if summary["max_size"] is None:
        head = f"{summary['system']}: nothing trained"
    else:
        steady_seconds = summary.get("steady_seconds")
        head = (f"{summary['system']}: max {summary['size_name']} {summary['max_size']} "
                f"({summary['parameters']:,} parameters, first step "
                f"{summary['first_step_seconds']} s, {summary.get('replans') or 0} re-plans, "
                + (f"steady step {steady_seconds:.3f} s)" if steady_seconds
                   else "steady state not measured)"))
    after = (f"; {summary['size_name']} {summary['first_failing_size']} failed: "
             f"{summary['limit_text']}" if summary["first_failing_size"] else
             (f"; search stopped: {summary['limit_text']}" if summary["limit"] else ""))
    return f"{head}{after}; {summary['trials']} trials in {summary['search_seconds']:.0f} s"
