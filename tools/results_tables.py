"""Regenerate the result tables of README.md and docs/results.md from experiments/results/.

    python tools/results_tables.py            # rewrite the generated blocks in place
    python tools/results_tables.py --check    # exit 1 (and say where) if a block is stale

A generated block sits between two markers that name its source:

    <!-- results:resnet-quick -->
    ... written by this script from experiments/results/resnet-quick.json ...
    <!-- /results:resnet-quick -->

`<name>` is a result file's stem: an experiment's `--find-max` output
(`resnet-quick.json`, with its provenance, cap, table, RESULT line and, for
DeepSpeech, the iteration-time table), the soak's (`soak.json`, written by
`python tools/soak.py --json experiments/results/soak.json`) or budget mode's
table (`budget.json`, written by `python tools/budget_table.py`) or the TF2
step-time benchmark's (`tf2_speed.json`, written by
`python tools/bench_tf2.py --json experiments/results/tf2_speed.json`) or the
simulator accuracy's (`accuracy.json`, written by
`python experiments/accuracy.py --json experiments/results/accuracy.json`) or the
benchmark's (`bench-*.json`, written by `python tools/bench.py ... --json OUT`: its own
report, as it printed it).  Text outside
the markers is left alone, so the prose around a table stays hand-written,
but no figure inside a block can drift from the file that produced it.

One block reads several files: `<!-- results:headline -->` (README.md's
headline table) summarises the experiments bounded by memory listed in
HEADLINE, one row each.
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "results.md")
# The headline table's rows: (result file stem, what the experiment grows).
HEADLINE = (("resnet-memory", "ResNet depth"), ("resnet-memory-oneregion", "ResNet depth"),
            ("moe-memory", "MoE experts per layer"), ("moe-budget-memory", "MoE experts per layer"),
            ("deepspeech-memory", "DeepSpeech sequence length"),
            ("deepspeech-memory-tfmemconfig", "DeepSpeech sequence length"),
            ("keras_resnet50-quick-state0.1", "Keras ResNet-50 `fit`, state a tenth of the cap"),
            ("keras_resnet50-quick-state0.33", "Keras ResNet-50 `fit`, state a third of the cap"))
BLOCK = re.compile(r"(<!-- results:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results:(?P=name) -->)",
                   re.S)
MIB = 1 << 20

sys.path.insert(0, str(ROOT))  # run as a script: import from the root


def _provenance(info):
    from tfmem.cli import provenance  # pylint: disable=import-outside-toplevel
    return provenance.describe(info) if info else "provenance not recorded"


def _work_unit(script):
    """The unit of work of experiments/<script>.py (its EXPERIMENT.work_unit), or None."""
    import importlib  # pylint: disable=import-outside-toplevel
    try:
        return importlib.import_module(f"experiments.{script}").EXPERIMENT.work_unit
    except (ImportError, AttributeError):
        return None


def experiment_block(data, name):
    """The markdown of an experiment's result file."""
    # pylint: disable=import-outside-toplevel
    from experiments.harness.cap import cap_peak_text
    from experiments.harness.reports import markdown_table, result_line, step_path_text
    settings, summaries = data["settings"], data["summaries"]
    size_name = summaries[0]["size_name"] if summaries else "size"
    unit = summaries[0]["unit"] if summaries else "examples"
    script = name.split("-", 1)[0]
    command = data.get("command") or (
        f"python experiments/{script}.py" + (" --quick" if settings.get("quick") else ""))
    cap = data.get("cap")
    if cap and cap.get("note"):
        cap_text = f"cap {cap['note']}"
    elif cap:
        cap_text = (f"cap {cap['cap_mib']} MiB: plain TensorFlow's peak at {cap['size_name']} "
                    f"{cap['base_size']} measured on the machine ({cap_peak_text(cap)}, "
                    f"{cap['kernel_path']}, BFC allocator without a cap) x {cap['factor']:g}")
    else:
        cap_text = f"cap {settings.get('device_memory')} MiB (given)"
    steps = (f"tfmem: {step_path_text(settings)}; "
             if "partial_runs" in settings else "")
    if settings.get("session_config", "default") != "default":  # experiments/harness/options.py
        steps += f"every session: {settings['session_config']} config (Grappler off); "
    if settings.get("allocator", "grown") != "grown":  # experiments/harness/reports.allocator_note
        steps += "every trial's cap reserved as one region first; "
    lines = [f"`{command}` ({cap_text}; batch {settings.get('batch_size')}; {steps}"
             f"trial limit {settings.get('trial_timeout', 0):.0f} s; whole run "
             f"{data.get('seconds', 0):.0f} s; {_provenance(data.get('provenance'))}):", "",
             markdown_table(summaries, size_name, unit, _work_unit(script)), ""]
    failures = [f"- {s['system']} at {size_name} {s['first_failing_size']}: {s['failure']}"
                for s in summaries if s.get("first_failing_size") and s.get("failure")]
    lines += failures + ([""] if failures else [])
    lines += [f"    {data.get('result') or result_line(summaries)}", ""]
    if script.startswith("keras_") and data.get("extra"):
        from experiments import keras_common  # pylint: disable=import-outside-toplevel
        lines += keras_common.stored_report(data).strip().splitlines() + [""]
    elif data.get("extra_markdown"):
        extra = data["extra_markdown"].strip().splitlines()
        if extra and extra[0].startswith("#"):
            extra[0] = "**" + extra[0].lstrip("# ").strip() + "**"
        lines += extra + [""]
    return "\n".join(lines)


def soak_block(data):
    """The markdown of a soak's result file."""
    samples, growth, args = data["samples"], data["growth_per_1000"], data["args"]
    device = [s["device"] for s in samples]
    rss = [s["rss"] for s in samples]
    buffers = [s["host_buffers"] for s in samples]
    plain = data.get("plain_peak")
    lines = [
        f"`python tools/soak.py --steps {args['steps']} --json experiments/results/soak.json` "
        f"({_provenance(data.get('provenance'))}):", "",
        f"- model: `tfmem.cli.models.mlp(layers={args['layers']}, width={args['width']})`, batch "
        f"{args['batch']}, momentum SGD; plain TensorFlow's peak for one step "
        + (f"{plain / MIB:.1f} MiB" if plain else "not measured")
        + f"; cap {data['cap_mib']} MiB"
        + (" (half that peak)" if args.get("cap") == "auto" else ""),
        f"- tfmem: partition_size={args['partition_size']} -> {data['partitions']} partitions "
        f"(size {data['partition_size']}), {data['swapped']} tensors swapped, "
        f"{data['swapped_out_bytes'] / MIB:.1f} MiB out per step; {samples[-1]['step']} steps "
        f"in {data['seconds']:.0f} s ({data['seconds'] / samples[-1]['step'] * 1e3:.0f} ms per "
        f"step); {len(samples)} samples from step {samples[0]['step']} every {args['every']}",
        "",
        "| figure | first sample | last sample | growth per 1000 steps (least squares) |",
        "|---|---|---|---|",
        f"| TensorFlow device memory between steps | {device[0]:,} B | {device[-1]:,} B | "
        f"{growth['device'] / 1024:+.1f} KiB ({'the same at every sample' if len(set(device)) == 1 else f'{min(device):,} .. {max(device):,} B'}) |",
        f"| host buffer pool | {buffers[0] / MIB:.1f} MiB | {buffers[-1] / MIB:.1f} MiB | "
        f"{growth['host_buffers'] / MIB:+.2f} MiB |",
        f"| host RSS (after malloc_trim) | {rss[0] / MIB:.1f} MiB | {rss[-1] / MIB:.1f} MiB | "
        f"{growth['rss'] / MIB:+.2f} MiB over the later half "
        f"({growth.get('rss_all', growth['rss']) / MIB:+.2f} over all samples; tolerance "
        f"{args['rss_tolerance']} MiB) |",
        f"| device peak per step | | {data['max_device_peak'] / MIB:.2f} MiB at most | "
        + (f"{data['max_device_peak'] / plain:.2f}x plain TensorFlow's peak |" if plain else "|"),
        "",
        f"- loss {data['first_loss']:.5f} -> {data['last_loss']:.5f} (all finite: "
        f"{data['finite']})",
        f"- {data['verdict'][-1] if data.get('verdict') else ''}", ""]
    return "\n".join(lines)


def budget_block(data):
    """The markdown of tools/budget_table.py's result file."""
    from tools import budget_table  # pylint: disable=import-outside-toplevel
    caps = " ".join(str(c) for c in data["caps"])
    return "\n".join([
        f"`python tools/budget_table.py --caps {caps} --steps {data['steps']}` (margin "
        f"{data['margin']:.0%}; {_provenance(data.get('provenance'))}):", "",
        budget_table.markdown(data["rows"]), ""])


def tf2_speed_block(data):
    """The markdown of tools/bench_tf2.py's result file: tfmem.function / tf.function."""
    args, goals = data["args"], data.get("goals", {})
    flags = f" --steps {args['steps']} --warmup {args['warmup']}"
    for option, default in (("partition_sizes", ["200", "auto"]), ("blocks", [3, 3, 3]),
                            ("batch", 32), ("budget", "8GiB"), ("onednn", "0"), ("intra", 1),
                            ("inter", 2)):
        value = args.get(option, default)
        if value != default:
            value = " ".join(map(str, value)) if isinstance(value, list) else value
            flags += f" --{option.replace('_', '-')} {value}"
    lines = [
        f"`python tools/bench_tf2.py{flags} --json experiments/results/tf2_speed.json` "
        f"(ResNet blocks {tuple(args['blocks'])}, batch {args['batch']}; {args['steps']} timed "
        f"steps per side after {args['warmup']} warm-up, alternating; intra-op threads "
        f"{args.get('intra', 'default')}, inter-op {args.get('inter', 'default')}; "
        f"{_provenance(data.get('provenance'))}):", "",
        "| configuration | partitions | ops | plain ms | tfmem ms | ratio (goal) | paired | "
        "CPU ratio | first step plain s | first step tfmem s | steps whose loss differs | "
        "max rel. loss diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for row in data["rows"]:
        size = str(row["partition_size"])
        name = "budget mode (step fits)" if size == "auto" else f"partition_size={size}"
        goal = goals.get(size)
        mark = f" (<= {goal}: {'met' if row['ratio'] <= goal else 'MISSED'})" if goal else ""
        lines.append(
            f"| {name} | {row['partitions']} | {row['ops']} | {row['plain_ms']:.1f} | "
            f"{row['tfmem_ms']:.1f} | {row['ratio']:.3f}{mark} | {row['paired']:.3f} | "
            f"{row['cpu_ratio']:.3f} | {row['first_plain_s']:.1f} | {row['first_tfmem_s']:.1f} | "
            f"{row['loss_diff_steps']} of {row['steps'] + args['warmup'] + 1} | "
            f"{row['max_loss_rel_diff']:.1e} |")
        if goal:
            verdicts.append(f"step_ratio_{size}={row['ratio']:.3f} (goal <= {goal}) "
                            f"{'ok' if row['ratio'] <= goal else 'MISSED'}")
    lines += [""] + [f"    TARGET {v}" for v in verdicts] + ([""] if verdicts else [])
    return "\n".join(lines)


def accuracy_block(data):
    """The markdown of experiments/accuracy.py's result file: predicted against measured peaks."""
    from experiments import accuracy  # pylint: disable=import-outside-toplevel
    return "\n".join([
        f"`python experiments/accuracy.py --json experiments/results/accuracy.json` (steps 2-"
        f"{data['steps']} judged; {_provenance(data.get('provenance'))}):", "",
        accuracy.markdown(data["rows"]), "", f"    {accuracy.summary(data['rows'])}", ""])


def bench_block(data, name):
    """The markdown of tools/bench.py's result file: its own report, as it printed it."""
    from tools import bench  # pylint: disable=import-outside-toplevel
    lines = []
    bench.report(data, out=lambda text="": lines.extend(str(text).split("\n")))
    argv, skip = [], False
    for arg in data["argv"]:  # all but --json OUT, which the block names itself
        if not skip and not arg.startswith("--json"):
            argv.append(arg)
        skip = arg == "--json"
    argv = " ".join(argv)
    return "\n".join([
        f"`python tools/bench.py {argv} --json experiments/results/{name}.json` "
        f"(whole run {data['total_s']:.0f} s; {_provenance(data.get('provenance'))}):", "",
        "```", *lines, "```", ""])


def _tfmem_setting(settings):
    """How tfmem ran in an experiment's search, in a few words."""
    size = settings.get("partition_size")
    words = ["budget mode" if size == "auto" else f"partition_size={size}"]
    if settings.get("partial_runs"):
        words.append("partial runs")
    if settings.get("allocator", "grown") != "grown":
        words.append("cap reserved as one region")
    if settings.get("session_config", "default") != "default":
        words.append("every session with tfmem's config")
    return ", ".join(words)


def headline_block():
    """README.md's headline table: the largest model plain TensorFlow and tfmem trained
    under the same emulated cap, one row per experiment of HEADLINE."""
    lines = ["| model, what grows | cap MiB | plain TensorFlow | tfmem | ratio | tfmem ran with | "
             "what stopped tfmem | result file, provenance |", "|---|---|---|---|---|---|---|---|"]
    for name, grows in HEADLINE:
        data = json.loads((RESULTS / f"{name}.json").read_text())
        by_system = {s["system"]: s for s in data["summaries"]}
        plain, tfm = by_system.get("tf") or by_system["plain"], by_system["tfmem"]
        origin = data.get("provenance") or {}
        lines.append(
            f"| {grows} ({plain['size_name']}) | {plain['device_memory_mib']} | "
            f"{plain['max_size']} | {tfm['max_size']} | "
            f"{tfm['max_size'] / plain['max_size']:.2f}x | {_tfmem_setting(data['settings'])} | "
            f"{tfm.get('limit_text') or '-'} | `{name}.json`, commit "
            f"{(origin.get('commit') or '?')[:7]}, {origin.get('date', '?')[:10]} |")
    return "\n".join(lines + [""])


def block(name):
    """The generated markdown for `name`, from experiments/results/<name>.json."""
    if name == "headline":
        return headline_block()
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} (named by a results marker) does not exist")
    data = json.loads(path.read_text())
    if "samples" in data and "growth_per_1000" in data:
        return soak_block(data)
    if data.get("kind") == "budget-table":
        return budget_block(data)
    if data.get("kind") == "tf2-speed":
        return tf2_speed_block(data)
    if data.get("kind") == "bench":
        return bench_block(data, name)
    if data.get("kind") == "simulator-accuracy":
        return accuracy_block(data)
    if data.get("kind") == "planning":
        from tools import bench_planning  # pylint: disable=import-outside-toplevel
        return bench_planning.markdown(data, _provenance(data.get("provenance")))
    return experiment_block(data, name)


def regenerate(text):
    """`text` with every generated block rewritten; (new text, names of the blocks)."""
    names = []

    def replace(match):
        names.append(match.group("name"))
        return match.group(1) + block(match.group("name")) + match.group(4)

    return BLOCK.sub(replace, text), names


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a generated block differs from its file")
    args = parser.parse_args(argv)
    stale = []
    for document in DOCUMENTS:
        if not document.exists():
            continue
        text = document.read_text()
        try:
            new, names = regenerate(text)
        except (FileNotFoundError, KeyError, ValueError) as err:
            print(f"{document.relative_to(ROOT)}: cannot regenerate: {err}")
            return 1
        if new != text:
            stale.append(str(document.relative_to(ROOT)))
            if not args.check:
                document.write_text(new)
        print(f"{document.relative_to(ROOT)}: {len(names)} generated block(s)"
              + (f": {', '.join(names)}" if names else "")
              + (" (stale)" if new != text and args.check else
                 " (rewritten)" if new != text else " (up to date)"))
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run python tools/results_tables.py")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
