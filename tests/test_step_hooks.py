"""The public per-step hooks tools use: `tracing(path)` and `add_step_listener`."""

import dataclasses
import json

import numpy as np
import pytest

import tfmem
from conftest import assert_same_result, build_mlp


def test_tracing_traces_only_the_steps_inside_the_block(pair, tmp_path):
    model = build_mlp()
    plain, tfs = pair(model.graph, 6, model.init)
    path = tmp_path / "steps.json"
    first = tfs.run([model.loss, model.train], model.data[0])
    assert not path.exists()
    with tfs.tracing(str(path)):
        traced = tfs.run([model.loss, model.train], model.data[1])
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    calls = [e for e in events if e["name"].startswith("partition")]  # a stretch: several
    assert len(calls) == tfs.last_step.calls >= 1
    assert sum(e["args"]["partitions"] for e in calls) == tfs.last_step.partitions > 1
    path.unlink()
    tfs.run([model.loss, model.train], model.data[2])
    assert not path.exists()  # the block's end restored the session's own setting (none)
    expected = [plain.run([model.loss, model.train], model.data[i]) for i in range(2)]
    assert_same_result(expected, [first, traced])


def test_a_step_listener_sees_every_step_as_a_read_only_record(pair):
    model = build_mlp()
    _, tfs = pair(model.graph, 6, model.init)
    seen = []
    tfs.add_step_listener(lambda session, record: seen.append((session, record)))
    losses = [tfs.run(model.loss, model.data[i]) for i in range(3)]
    assert len(seen) == 3 and all(session is tfs for session, _ in seen)
    records = [record for _, record in seen]
    assert all(isinstance(r, tfmem.StepRecord) for r in records)
    assert records[-1].stats is tfs.last_step
    assert [r.step for r in records] == [r.stats.step for r in records] == \
        [records[0].step + i for i in range(3)]
    assert [r.planned for r in records] == [True, False, False]  # planned on its first step
    assert records[0].compile is not None and records[0].compile.callables > 0
    assert records[1].compile is None and records[2].compile is None
    plan = tfs.plan(model.loss, model.data[0])
    assert all(r.plan is plan for r in records) and plan.partitions == records[0].plan.partitions
    assert records[0].prediction().peak_device == \
        tfs.simulate(model.loss, model.data[0]).peak_device
    assert records[0].feed_shapes == {t.name: np.shape(v) for t, v in model.data[0].items()}
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].planned = False
    assert np.all(np.isfinite(losses))


def test_a_listener_taking_entry_and_stats_still_runs_and_is_warned_about(pair):
    model = build_mlp()
    _, tfs = pair(model.graph, 6, model.init)
    seen = []
    with pytest.warns(DeprecationWarning, match=r"take \(tfs, record\)") as warned:
        tfs.add_step_listener(lambda session, entry, stats: seen.append((session, entry, stats)))
    assert warned[0].filename == __file__
    tfs.run(model.loss, model.data[0])
    [(session, record, stats)] = seen
    assert session is tfs and stats is tfs.last_step and record.stats is stats
    assert record.plan is tfs.plan(model.loss, model.data[0])
