"""The experiments' max-size search and its reports, on fake trials (nothing trains).

The search (exponential, then binary, stopping at a failure that is not a size
limit), the per-system summaries, the table, CSV and plot writers, the RESULT
line, and a run that breaks or shares its kernel scratch file.
"""

import csv
import json
import os
from pathlib import Path

import pytest

from experiments import resnet
from experiments.harness import experiment, main, options, reports, search, steady

MIB = 1 << 20


def _fake(limit, calls, seconds_per_layer=0.001):
    def trial(k):
        calls.append(k)
        size, ok = resnet.layers_of(k), k <= limit
        steady_seconds = seconds_per_layer * size if ok else None
        return dict(index=k, size=size, system="tf", size_name="layers",
                    ok=ok, status="ok" if ok else "oom",
                    throughput=100.0 / k, parameters=1000 * k, peak_bytes=k * MIB,
                    state_bytes=k * MIB // 4, error=None if ok else "OOM",
                    first_step_seconds=1.0 + k, replans=k % 3, steady_seconds=steady_seconds,
                    steady_ms_per_unit=steady.ms_per_unit(steady_seconds, size, 16))
    return trial


def test_find_max_exponential_then_binary():
    calls = []
    outcome = search.find_max(_fake(37, calls), 1, resnet.layers_of)
    assert outcome["best"] == 37 and outcome["failed_at"] == 38
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert len(calls) <= 7 + 6


def test_find_max_failing_start_searches_down_and_tolerance_stops_early():
    calls = []
    assert search.find_max(_fake(5, calls), 40, resnet.layers_of)["best"] == 5
    calls = []
    outcome = search.find_max(_fake(100, calls), 1, resnet.layers_of, tolerance=0.1)
    assert 91 <= outcome["best"] <= 100 and outcome["failed_at"] - outcome["best"] <= 10
    assert search.find_max(_fake(0, []), 4, resnet.layers_of)["best"] == 0


def test_find_max_stops_at_a_failure_that_is_not_a_size_limit():
    def trial(k):
        ok = k < 4
        status = "ok" if ok else "error"
        return dict(index=k, size=resnet.layers_of(k), system="tfmem", size_name="layers",
                    ok=ok, status=status, throughput=1.0, parameters=k, peak_bytes=MIB,
                    state_bytes=MIB, error=None if ok else "KeyError: 'x' (a tfmem bug)")
    outcome = search.find_max(trial, 1, resnet.layers_of)
    assert outcome["stopped"] == "failure" and outcome["failed_at"] is None
    assert outcome["failure"]["error"].startswith("KeyError")
    assert len(outcome["trials"]) == 3  # 1, 2, then 4 failed: no bisection on a bug
    args = options.parse_args(resnet.EXPERIMENT, ["--quick"])
    summary = search.summarise(resnet.EXPERIMENT, args, "tfmem", outcome)
    assert summary["run_failed"] and summary["limit_text"].startswith("FAILURE")
    assert not summary["limit_text"].startswith("device memory")
    reason = reports.run_failure([summary])
    assert "KeyError" in reason
    assert reports.result_line([summary], reason).startswith(
        'RESULT system=tfmem max=10 ratio=n/a reason="tfmem failed at layers=14: KeyError')


@pytest.mark.parametrize("system, status, limit", [
    ("tf", "oom", True), ("tfmem", "oom", True), ("tfmem", "budget", True),
    ("tfmem", "host-memory", True), ("tfmem", "timeout", True),
    ("tf", "crash", True), ("grappler", "crash", True),  # recorded as a crash, not as memory
    ("tfmem", "crash", False), ("tf", "error", False), ("tfmem", "error", False)])
def test_only_does_not_fit_outcomes_are_size_limits(system, status, limit):
    assert experiment.is_size_limit(dict(system=system, status=status)) is limit
    assert "device memory" not in experiment.LIMITS["crash"]


def test_find_max_respects_max_size_and_trial_budget():
    outcome = search.find_max(_fake(1000, []), 1, resnet.layers_of, max_index=20)
    assert outcome["best"] == 20 and outcome["stopped"] == "max-size"
    outcome = search.find_max(_fake(1000, []), 1, resnet.layers_of, max_trials=3)
    assert outcome["best"] == 4 and outcome["stopped"] == "max-trials"


# --------------------------------------------------------------------------
# reports from fake results


def _summaries():
    """tf, grappler and tfmem searches on fake trials; tfmem's steady step costs 1.5x plain's
    per layer."""
    args = options.parse_args(resnet.EXPERIMENT, ["--quick"])
    summaries = []
    for system, limit, per_layer in (("tf", 6, 0.002), ("grappler", 5, 0.002),
                                     ("tfmem", 30, 0.003)):
        outcome = search.find_max(_fake(limit, [], per_layer), 1, resnet.layers_of)
        for t in outcome["trials"]:
            t["system"] = system
        summaries.append(search.summarise(resnet.EXPERIMENT, args, system, outcome))
    return args, summaries


def test_summary_rows_and_result_line():
    _, summaries = _summaries()
    assert [s["max_size"] for s in summaries] == [18, 16, 66]
    assert summaries[0]["first_failing_size"] == 20
    assert summaries[0]["limit_text"].startswith("device memory")
    assert reports.result_line(summaries) == "RESULT system=tfmem max=66 ratio=3.67"


def test_the_table_reports_first_step_replans_and_steady_cost_against_plain():
    _, summaries = _summaries()
    tf_row, _, tfm_row = reports.table_rows(summaries)
    tfm = summaries[2]
    assert (tfm_row["first_step_seconds"], tfm_row["replans"]) == (31.0, 0)  # index 30
    assert tfm_row["steady_seconds"] == round(tfm["steady_seconds"], 3)
    assert tfm_row["throughput"] == round(16 / tfm["steady_seconds"], 2)
    # per layer-image at each one's own max size: tfmem at 66 layers, plain at 18
    tfm_cost = tfm["steady_seconds"] * 1000 / (66 * 16)
    plain_cost = summaries[0]["steady_seconds"] * 1000 / (18 * 16)
    assert tfm_row["steady_ms_per_unit"] == round(tfm_cost, 4)
    assert tfm_row["vs_plain"] == round(tfm_cost / plain_cost, 2) == 1.5
    assert tf_row["vs_plain"] == 1.0
    table = reports.markdown_table(summaries, "layers", "images")
    head, _, *rows = table.splitlines()
    for column in ("first step s", "re-plans", "steady step s", "steady images/s",
                   "steady ms per layer-image", "vs plain at plain's max"):
        assert column in head
    assert rows[2].startswith(
        f"| tfmem | 16 | 66 | 30,000 | 31.00 | 0 | {tfm['steady_seconds']:.3f} |")
    assert "| 1.50x |" in rows[2] and "| 1.00x |" in rows[0]


def test_a_summary_without_steady_figures_shows_them_as_not_measured():
    """Result files written before trials measured a steady state keep rendering: their
    steady-state cells are "-"."""
    _, summaries = _summaries()
    for summary in summaries:
        for key in ("replans", "steady_seconds", "steady_ms_per_unit", "steady_step_count",
                    "work_unit"):
            del summary[key]
    rows = reports.markdown_table(summaries, "layers", "images", "layer-image").splitlines()[2:]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[5:10] == ["-"] * 5  # re-plans, steady s, steady/s, ms per unit, vs plain
        assert cells[4] != "-"  # the first step was recorded
    from tools import results_tables  # pylint: disable=import-outside-toplevel
    args, _ = _summaries()
    data = dict(settings=vars(args), summaries=summaries, seconds=1.0, result="RESULT x")
    block = results_tables.experiment_block(json.loads(json.dumps(data, default=str)),
                                            "resnet-old")
    assert "steady ms per layer-image" in block and "| tfmem | 16 | 66 |" in block


def test_markdown_csv_and_plot_written(tmp_path):
    args, summaries = _summaries()
    args.out_dir, args.tag = tmp_path, "fake"
    paths = reports.write_reports(resnet.EXPERIMENT, args, summaries, 12.0, out=lambda _: None)
    markdown = (tmp_path / "resnet-fake.md").read_text()
    header = markdown.splitlines()[2]
    for column in ("system", "batch", "max layers", "parameters", "steady images/s",
                   "steady ms per layer-image", "vs plain at plain's max"):
        assert column in header
    assert "| tfmem | 16 | 66 |" in markdown
    assert "RESULT system=tfmem max=66 ratio=3.67" in markdown
    with open(tmp_path / "resnet-fake.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["system"] for r in rows] == ["tf", "grappler", "tfmem"]
    assert rows[2]["max_size"] == "66" and rows[0]["parameters"] == "6000"
    assert rows[2]["vs_plain"] == "1.5" and rows[2]["replans"] == "0"
    with open(tmp_path / "resnet-fake-trials.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == sum(s["trials"] for s in summaries)
    saved = json.loads((tmp_path / "resnet-fake.json").read_text())
    assert saved["summaries"][2]["max_size"] == 66
    origin = saved["provenance"]
    assert len(origin["commit"]) == 40 and origin["tensorflow"].startswith("2.")
    assert origin["kernel_path"] == {"tf": "oneDNN off", "grappler": "oneDNN off",
                                     "tfmem": "oneDNN off"}
    assert origin["cpu_count"] >= 1 and origin["date"].startswith("20")
    assert saved["result"] == "RESULT system=tfmem max=66 ratio=3.67"
    assert f"produced by commit {origin['commit'][:12]}" in markdown
    try:
        import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        assert "matplotlib" in markdown and not (tmp_path / "resnet-fake.png").exists()
    else:
        assert (tmp_path / "resnet-fake.png").stat().st_size > 1000
        assert str(tmp_path / "resnet-fake.png") in paths


def test_reports_of_a_run_where_nothing_trained(tmp_path):
    args, summaries = _summaries()
    for summary in summaries:
        for t in summary["all_trials"]:
            t["ok"], t["status"] = False, "oom"
    args.out_dir, args.tag = tmp_path, "nothing"
    reports.write_reports(resnet.EXPERIMENT, args, summaries, 1.0, out=lambda _: None)
    assert "no plot: no trial trained" in (tmp_path / "resnet-nothing.md").read_text()


def test_a_run_that_breaks_ends_with_a_message_and_its_result_line(tmp_path, monkeypatch,
                                                                   capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("the search broke")
    monkeypatch.setattr(main, "search_systems", broken)
    code = main.main(resnet.EXPERIMENT, ["--quick", "--device-memory", "50",
                                           "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 1
    assert out[-1] == 'RESULT system=tfmem max=none ratio=n/a reason="the run stopped: ' \
                      'RuntimeError: the search broke"'


def test_a_runs_trials_share_one_kernel_scratch_file(tmp_path, monkeypatch):
    """Trial processes inherit one file for the run (each kernel measured once per run),
    removed with the run; a file the user named is used as it is."""
    from tfmem.memory import scratch  # pylint: disable=import-outside-toplevel
    assert main.SCRATCH_CACHE_ENV == scratch.CACHE_ENV
    monkeypatch.delenv(scratch.CACHE_ENV, raising=False)
    seen = []

    def stop(*args, **kwargs):
        seen.append(os.environ.get(scratch.CACHE_ENV))
        raise RuntimeError("stop here")
    monkeypatch.setattr(main, "search_systems", stop)
    argv = ["--quick", "--device-memory", "50", "--out-dir", str(tmp_path)]
    main.main(resnet.EXPERIMENT, argv)
    assert seen[0] and Path(seen[0]).name == "scratch.json"
    assert scratch.CACHE_ENV not in os.environ and not Path(seen[0]).parent.exists()
    monkeypatch.setenv(scratch.CACHE_ENV, str(tmp_path / "mine.json"))
    main.main(resnet.EXPERIMENT, argv)
    assert seen[1] == str(tmp_path / "mine.json")
