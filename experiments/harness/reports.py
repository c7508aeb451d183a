"""A search's outputs: the paper-shaped table (markdown and CSV), every trial as CSV
and JSON, a PNG of size against steady-state throughput, the notes on how the run was
made, and the RESULT line."""

import csv
import json
import sys
from pathlib import Path

from experiments.harness.cap import cap_note, provenance, provenance_note
from experiments.harness.experiment import GRAPPLER_MEMORY_OPTIMIZATION, MIB

COLUMNS = ("system", "batch", "max_size", "parameters", "first_step_seconds", "replans",
           "steady_seconds", "throughput", "steady_ms_per_unit", "vs_plain", "peak_mib",
           "resident_mib", "state_mib", "partitions", "first_failing_size", "limit", "failure",
           "trials", "search_seconds")


def _rounded(value, digits):
    return None if value is None else round(value, digits)


def vs_plain(summary, summaries):
    """A system's steady cost per unit of work at its maximum size over plain TensorFlow's
    at plain's maximum size, or None when either was not measured."""
    plain = next((s for s in summaries if s["system"] == "tf"), None)
    mine, theirs = summary.get("steady_ms_per_unit"), (plain or {}).get("steady_ms_per_unit")
    return mine / theirs if mine and theirs else None


def table_rows(summaries):
    """Flat rows (COLUMNS) of the per-system summaries.  Throughput is batch over the
    steady-state step; summaries without steady-state figures have none of these (None)."""
    rows = []
    for s in summaries:
        steady_seconds = s.get("steady_seconds")
        rows.append(dict(
            system=s["system"], batch=s["batch_size"], max_size=s["max_size"],
            parameters=s["parameters"], first_step_seconds=s["first_step_seconds"],
            replans=s.get("replans"), steady_seconds=_rounded(steady_seconds, 3),
            throughput=_rounded(s["batch_size"] / steady_seconds if steady_seconds else None, 2),
            steady_ms_per_unit=_rounded(s.get("steady_ms_per_unit"), 4),
            vs_plain=_rounded(vs_plain(s, summaries), 2),
            peak_mib=s["peak_mib"], resident_mib=s["resident_mib"], state_mib=s["state_mib"],
            partitions=s["partitions"], first_failing_size=s["first_failing_size"],
            limit=s["limit_text"], failure=s["failure"], trials=s["trials"],
            search_seconds=s["search_seconds"]))
    return rows


def cell(value):
    """A table cell: "-" for None, two decimals, thousands separators."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _ms(value):
    """Milliseconds per unit of work with three significant digits (they span 1e-3..10)."""
    return "-" if value is None else f"{value:.3g}"


def markdown_table(summaries, size_name, unit, work_unit=None):
    """The paper-shaped table (system, batch, max size, parameters) with each system's
    first step, re-plans and steady state at its maximum size, and context.  A summary
    without steady-state figures shows "-" there (not measured)."""
    work_unit = work_unit or next((s["work_unit"] for s in summaries if s.get("work_unit")),
                                  f"{size_name}-example")
    head = ["system", "batch", f"max {size_name}", "parameters", "first step s", "re-plans",
            "steady step s", f"steady {unit}/s", f"steady ms per {work_unit}",
            "vs plain at plain's max", "peak MiB", "resident MiB", "state MiB", "partitions",
            f"first failing {size_name}", "what stopped it", "trials", "search s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table_rows(summaries):
        cells = [cell(c) for c in (row["system"], row["batch"], row["max_size"],
                                    row["parameters"], row["first_step_seconds"], row["replans"])]
        cells += ["-" if row["steady_seconds"] is None else f"{row['steady_seconds']:.3f}",
                  cell(row["throughput"]), _ms(row["steady_ms_per_unit"]),
                  "-" if row["vs_plain"] is None else f"{row['vs_plain']:.2f}x"]
        cells += [cell(c) for c in (row["peak_mib"], row["resident_mib"], row["state_mib"],
                                     row["partitions"], row["first_failing_size"], row["limit"],
                                     row["trials"], row["search_seconds"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_markdown(summaries, path, title, notes=()):
    size_name = summaries[0]["size_name"] if summaries else "size"
    unit = summaries[0]["unit"] if summaries else "examples"
    text = [f"# {title}", "", markdown_table(summaries, size_name, unit), ""]
    text += [f"- {note}" for note in notes]
    Path(path).write_text("\n".join(text).rstrip() + "\n")


def write_csv(summaries, path):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(table_rows(summaries))


TRIAL_COLUMNS = ("system", "size", "status", "parameters", "throughput", "peak_mib",
                 "first_step_seconds", "replans", "steady_seconds", "steady_ms_per_unit",
                 "steps", "seconds", "partitions", "error")


def write_trials_csv(summaries, path):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=TRIAL_COLUMNS)
        writer.writeheader()
        for summary in summaries:
            for t in summary["all_trials"]:
                writer.writerow(dict(
                    system=t["system"], size=t["size"], status=t.get("status"),
                    parameters=t.get("parameters"),
                    throughput=None if t.get("throughput") is None else round(t["throughput"], 3),
                    peak_mib=round(t["peak_bytes"] / MIB, 1) if t.get("peak_bytes") else None,
                    first_step_seconds=(None if t.get("first_step_seconds") is None
                                        else round(t["first_step_seconds"], 2)),
                    replans=t.get("replans"),
                    steady_seconds=_rounded(t.get("steady_seconds"), 4),
                    steady_ms_per_unit=_rounded(t.get("steady_ms_per_unit"), 5),
                    steps=len(t.get("step_times") or []) or None,
                    seconds=round(t.get("process_seconds") or t.get("seconds") or 0, 1),
                    partitions=(t.get("tfmem") or {}).get("partitions"),
                    error=(t.get("error") or "")[:200]))


def pyplot():
    """matplotlib.pyplot drawing to files (Agg), or None when matplotlib is missing."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    return plt


def write_plot(summaries, path, title):
    """Size against throughput of every trial that trained, one line per system.

    Returns None when written, else a note saying why not (matplotlib missing).
    """
    plt = pyplot()
    if plt is None:
        return "no plot: matplotlib is not installed (pip install matplotlib)"
    if not any(t.get("ok") and t.get("throughput") for s in summaries for t in s["all_trials"]):
        return "no plot: no trial trained"
    from matplotlib.ticker import ScalarFormatter  # pylint: disable=import-outside-toplevel
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for summary in summaries:
        points = sorted((t["size"], t["throughput"]) for t in summary["all_trials"]
                        if t.get("ok") and t.get("throughput"))
        line, = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                          label=f"{summary['system']} (max {summary['max_size'] or '-'})")
        if summary["first_failing_size"]:
            axis.axvline(summary["first_failing_size"], linestyle=":", linewidth=1,
                         color=line.get_color())
    unit = summaries[0]["unit"] if summaries else "examples"
    axis.set_xlabel((summaries[0]["size_name"] if summaries else "size")
                    + "  (dotted: smallest size that failed)")
    axis.set_ylabel(f"steady-state throughput ({unit}/s, log scale)")
    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(ScalarFormatter())
    axis.yaxis.set_minor_formatter(ScalarFormatter())
    axis.set_xlim(left=0)
    axis.set_title(title, fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def result_line(summaries, reason=None, baseline="tf"):
    """RESULT system=tfmem max=<size> ratio=<tfmem max / baseline max>[ reason="..."].

    `reason`: why the run has no trustworthy result (a failure of the run), if so.
    """
    by_system = {s["system"]: s for s in summaries}
    tfm, plain = by_system.get("tfmem"), by_system.get(baseline)
    best = tfm["max_size"] if tfm else None
    ratio = (f"{best / plain['max_size']:.2f}" if best and plain and plain["max_size"]
             else "n/a")
    line = f"RESULT system=tfmem max={best if best is not None else 'none'} ratio={ratio}"
    if reason:
        line += ' reason="' + " ".join(str(reason).split()).replace('"', "'") + '"'
    return line


def run_failure(summaries):
    """Why the run's result cannot be trusted (a search that failed), or None."""
    failed = [s for s in summaries if s.get("run_failed")]
    if failed:
        return "; ".join(f"{s['system']} failed at {s['size_name']}={s['first_failing_size']}: "
                         f"{s['failure']}" for s in failed)
    tfm = {s["system"]: s for s in summaries}.get("tfmem")
    if tfm is not None and not tfm["max_size"]:
        return f"tfmem trained no size ({tfm['limit_text']}: {tfm['failure']})"
    return None


def allocator_note(kind):
    """How every system's emulated device held its memory, in one line."""
    if kind == "one-region":
        return ("allocator: every trial (plain TensorFlow's too, and the cap's base trial) "
                "first reserves its cap as one region (tfmem.reserve_emulated_memory), as a "
                "GPU's allocator holds its memory")
    return ("allocator: TensorFlow's CPU allocator as it grows (regions of 2, 4, 8 ... MiB, "
            "the last one what the cap leaves)")


def session_config_note(kind):
    """Which session config every system's trials ran under, in one line."""
    if kind == "tfmem":
        return ("sessions: every system's session (plain TensorFlow's too, and the cap's "
                "base trial) runs tfmem.session_config(): Grappler's meta optimizer off, so "
                "grappler = tf, and tfmem plans sums without the regrouping rule")
    return "sessions: TensorFlow's default session config for every system"


def step_path_text(settings):
    """How tfmem's trials ran their steps (--partial-runs, --measure), in a few words."""
    measure = settings.get("measure") or "sample"
    if settings.get("partial_runs"):
        if measure == "off":
            return "partial runs (measure off: no step measured, budget mode learns nothing)"
        if settings.get("partition_size") == "auto" or settings.get("budget") is not None:
            return (f"partial runs (measure {measure}: budget mode measures them by "
                    "TensorFlow's process peak around each call and learns)")
        return f"partial runs (measure {measure}: measured steps run callables)"
    return f"callables (measure {measure})"


def steps_note(args):
    """How many steps each trial ran, in a few words."""
    if args.steps is not None:
        return f"{args.steps} steps per trial"
    return (f"steps per trial: until {args.steady_steps} follow the last re-plan, at most "
            f"{args.max_steps}")


def output_stem(experiment, args):
    """results/<model>-<tag>, the directory created: every output's path without suffix."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or ("quick" if args.quick else f"cap{args.device_memory}-b{args.batch_size}")
    if not args.tag and getattr(args, "state_share", None):  # the Keras experiments' setting
        tag += f"-state{args.state_share:g}"
    return out_dir / f"{experiment.name}-{tag}"


def command_line(experiment, argv=None):
    """The command that ran this search, as typed (script path relative to the repository)."""
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"python experiments/{Path(experiment.script).name}"] + args)


def write_reports(experiment, args, summaries, seconds, out=print, extra=None, cap_info=None,
                  started_from=None):
    """Markdown, CSV, trials CSV, JSON and PNG under args.out_dir; returns the paths.
    `started_from`: the provenance source() read when the search started."""
    stem = output_stem(experiment, args)
    origin = provenance(args, started_from, experiment.systems)
    cap = f"{args.device_memory} MiB" if args.device_memory else "no cap"
    title = f"{experiment.title}: largest {experiment.size} under {cap}, batch {args.batch_size}"
    model = ", ".join(f"{name.replace('_', ' ')} {getattr(args, name)}"
                      for name in experiment.model_args)
    tfmem_mode = (f"partition_size=auto (budget mode, budget "
                  f"{args.budget or args.device_memory} MiB)"
                  if args.partition_size == "auto" else f"partition_size={args.partition_size}")
    notes = [f"model: {model}; {steps_note(args)}; each system at its own max size: the first "
             "step, the re-plans after it (tfmem: steps that planned the request again), the "
             f"steady-state step = the median of the steps after the last re-plan (at least "
             f"{args.steady_steps}), throughput = batch / steady step, ms per "
             f"{experiment.work_unit} = steady step / ({experiment.size} x batch), and that "
             "over plain TensorFlow's at plain's own max size",
             *(experiment.system_notes(args) if experiment.system_notes else (
                 f"systems: tf = TensorFlow defaults; grappler = memory_optimization "
                 f"{GRAPPLER_MEMORY_OPTIMIZATION}; tfmem = TFMemSession {tfmem_mode}, swap "
                 f"{args.swap}, swap_distance {args.swap_distance}, prefetch {args.prefetch}, "
                 f"{step_path_text(vars(args))}", session_config_note(args.session_config))),
             allocator_note(args.allocator),
             f"search: exponential then binary on {experiment.size}, one process per trial, "
             f"trial time limit {args.trial_timeout:.0f} s, tolerance {args.tolerance:g}; "
             f"whole run {seconds:.0f} s",
             "peak MiB: TensorFlow's allocator peak over the steps at the max size; resident "
             "MiB: what the allocator still holds after the last step; state MiB: the variables "
             "(weights, momentum, moving averages), which stay on the emulated device",
             cap_note(experiment, args, cap_info), provenance_note(origin)]
    for summary in summaries:
        if summary["first_failing_size"]:
            notes.append(f"{summary['system']} at {experiment.size} "
                         f"{summary['first_failing_size']}: {summary['failure']}")
    notes.append(result_line(summaries, run_failure(summaries), experiment.baseline))
    note = write_plot(summaries, f"{stem}.png", title)
    if note:
        notes.append(note)
    write_markdown(summaries, f"{stem}.md", title, notes)
    if extra is not None:
        with open(f"{stem}.md", "a") as handle:
            handle.write("\n" + extra.markdown.rstrip() + "\n")
    write_csv(summaries, f"{stem}.csv")
    write_trials_csv(summaries, f"{stem}-trials.csv")
    with open(f"{stem}.json", "w") as handle:
        json.dump(dict(command=command_line(experiment),
                       settings={k: (str(v) if isinstance(v, Path) else v)
                                 for k, v in vars(args).items()},
                       provenance=origin, cap=cap_info, title=title,
                       notes=notes, result=result_line(summaries, run_failure(summaries),
                                                       experiment.baseline),
                       seconds=seconds, summaries=summaries,
                       extra=extra.data if extra is not None else None,
                       extra_markdown=extra.markdown if extra is not None else None),
                  handle, indent=1)
    paths = [f"{stem}.md", f"{stem}.csv", f"{stem}-trials.csv", f"{stem}.json"]
    if not note:
        paths.append(f"{stem}.png")
    else:
        out(note)
    return paths + list(extra.paths if extra is not None else ())
