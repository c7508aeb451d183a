"""The public per-step hooks tools use: `tracing(path)` and `add_step_listener`."""

import json

import numpy as np

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


def test_a_step_listener_sees_every_step_with_its_stats(pair):
    model = build_mlp()
    _, tfs = pair(model.graph, 6, model.init)
    seen = []
    tfs.add_step_listener(lambda session, entry, stats: seen.append((session, stats)))
    losses = [tfs.run(model.loss, model.data[i]) for i in range(3)]
    assert len(seen) == 3 and all(session is tfs for session, _ in seen)
    assert seen[-1][1] is tfs.last_step and seen[-1][1].partitions == tfs.last_step.partitions
    assert np.all(np.isfinite(losses))
