"""Smoke test of tools/bench.py: its functions on a tiny model, two steps, no timing asserted.

The capped part starts fresh processes (and TensorFlow's BFC allocator waits
10 s before it reports running out of memory), so here only its summary is
checked, on a synthetic child result.
"""

import json

import pytest

from tools import bench, bench_planning
from tools.bench_sections import capped, first_step, fits, planning, refusals, shared


def _trace(swap_out_us, upload_us):
    """A Chrome trace shaped like tfmem's: metadata events, then spans."""
    tracks = ("partitions", "swap-out", "prefetch", "wait")
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": i, "args": {"name": t}}
              for i, t in enumerate(tracks)]
    events.append({"ph": "X", "name": "partition 0", "pid": 1, "tid": 0, "ts": 0, "dur": 900})
    events.append({"ph": "X", "name": "a:0", "pid": 1, "tid": 1, "ts": 10, "dur": swap_out_us})
    events.append({"ph": "X", "name": "upload", "pid": 1, "tid": 2, "ts": 20, "dur": upload_us})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def test_bench_smoke_reports_ratio_fields():
    fitted = fits.run(blocks=(1, 1, 1), batch=4, width=4, image=8,
                      partition_sizes=(20, "auto"), steps=2, warmup=0, breakdown_steps=1)
    plan = planning.run(n_ops=400)
    results = dict(env=bench.environment("test"), fits=fitted, plan=plan)
    lines = []
    bench.report(results, out=lines.append)
    text = "\n".join(lines)

    by_size = {c["partition_size"]: c for c in fitted["configs"]}
    assert set(by_size) == {20, "auto"}
    assert by_size["auto"]["partitions"] == 1  # the budget is far above the step
    assert by_size[20]["partitions"] > 1
    for config in fitted["configs"]:
        for key in ("ratio", "paired_ratio", "cpu_ratio", "plain_ms", "tfmem_ms",
                    "overhead_ms_per_partition", "overhead_excl_transfers_ms_per_partition"):
            assert config[key] is not None, key
        assert len(config["plain_times_ms"]) == len(config["tfmem_times_ms"]) == 2
    assert fitted["plain_first_step_s"] > 0 and fitted["tfmem_config"] == "tfmem"
    compile_parts = by_size[20]["compile"]
    assert compile_parts["graph_ops_after"] > compile_parts["graph_ops_before"]
    assert by_size[20]["first_step_s"] >= compile_parts["callables_s"] > 0
    for name in ("fits_ps20_ratio", "auto_ratio", "overhead_ms_per_partition",
                 "cached_plan_s", "first_step_ps20_ratio"):
        assert f"TARGET {name}=" in text, name
    assert plan["partitions"] >= 2 and plan["cached_same_plan"]
    assert any(line.startswith("TARGET plan_") for line in lines)


def test_capped_summary_from_traces():
    trace = _trace(swap_out_us=100, upload_us=200)
    tracks = shared.trace_durations(trace)
    assert tracks["swap-out"] == (1, pytest.approx(100e-6))
    assert tracks["prefetch"] == (1, pytest.approx(200e-6))
    run = dict(step_times=[0.5, 0.4, 0.6], waits=[0.01, 0.02, 0.03], walls=[0.5, 0.4, 0.6],
               traced=[dict(wall=0.001, wait=0.0001,
                            tracks={k: list(v) for k, v in tracks.items()})])
    summary = capped.summarize(run, batch=100)
    assert summary["throughput"] == 100 / 0.5
    assert abs(summary["transfer_share"] - 0.3) < 1e-9
    assert abs(summary["prefetch_wait_share"] - 0.05) < 1e-9
    results = dict(env=bench.environment("test"),
                   capped=dict(model="MLP", batch=100, partition_size="auto", cap_mib=1,
                               plain_peak_mib=2.0, plain_uncapped=dict(step_times=[0.1]),
                               plain_capped=dict(oom=True, error="OOM", failed=False),
                               tfmem_capped=dict(run, failed=False, oom=False, partitions=3,
                                                 last_step="..."),
                               tfmem_peak_mib=1.0, **summary))
    lines = []
    bench.report(results, out=lines.append)
    assert "TARGET capped_plain=OOM (info)" in lines
    assert any(line.startswith("TARGET prefetch_wait_share=0.05 (goal < 0.1) ok")
               for line in lines)


def test_first_step_table_on_two_graph_sizes():
    """Rows per config and size; the copies of each plan land in the graph the row names:
    the user's for a wrapped session, tfmem.Session's own (no filler in it) for "tfmem"."""
    first = first_step.run(graph_ops=(400, 1500), partition_sizes=(50,),
                           configs=("tfmem", "default"), layers=2, batch=4)
    rows = first["rows"]
    assert [(r["config"], r["graph_ops"]) for r in rows] == [
        ("tfmem", 400), ("tfmem", 1500), ("default", 400), ("default", 1500)]
    for row in rows:
        assert row["user_graph_ops"] >= 0.95 * row["graph_ops"]  # the filler is ~sized
        if row["config"] == "default":
            assert row["session_graph_ops"] >= 0.95 * row["graph_ops"]
            assert row["copy_s"] == 0
        else:  # tfmem.Session copied the request into its own session graph
            assert row["copy_s"] > 0
        assert row["partitions"] >= 2 and row["added_ops"] > 0
        assert row["first_step_s"] >= row["callables_s"] > 0
    own = [r["session_graph_ops"] for r in rows if r["config"] == "tfmem"]
    assert own[0] == own[1] < 400
    lines = []
    bench.report(dict(env=bench.environment("test"), first_step=first), out=lines.append)
    assert any(line.startswith("TARGET compile_ratio_1k_0k=") for line in lines), lines
    assert any(line.startswith("TARGET compile_ratio_default_config_1k_0k=") for line in lines)


def test_bench_refusals_times_both_refusals():
    """The benchmark times both refusals (budget mode's and the host-memory guard's); the
    budget tests check what is refused, not how fast."""
    refused = refusals.run()
    assert refused["budget_refusal"] is not None and refused["budget_refusal"] > 0
    names = dict(bench.targets({"refusals": refused}))
    assert names["budget_refusal_s"] == refused["budget_refusal"]
    assert "host_guard_refusal_s" in names


def test_planning_bench_searches_and_reports_growth(tmp_path):
    out = tmp_path / "planning.json"
    assert bench_planning.main(["--blocks", "1", "2", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    small, large = data["rows"]
    assert small["ops"] < large["ops"]
    for row in data["rows"]:  # the budget lies below the whole step: budget mode searched
        assert row["budget_partitions"] > 1 and row["fixed_partitions"] >= 1
        assert row["search_seconds"] > 0 and row["fixed_seconds"] > 0
    assert data["growth_exponent"]["search_seconds"] is not None
    assert "| ops |" in bench_planning.markdown(data, "provenance")
