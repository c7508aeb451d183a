"""experiments/moe.py reports the state the placement pass would move off an accelerator."""

import tensorflow as tf

from experiments import moe
from experiments.harness import options

TINY = ["--layers", "1", "--d-model", "32", "--d-ff", "32", "--heads", "2", "--seq-len", "8",
        "--vocab", "32", "--batch-size", "2"]


def _state_bytes(experts, args):
    model = moe.build(tf, experts, args)
    with model.graph.as_default():
        return sum(v.shape.num_elements() * v.dtype.size for v in tf.compat.v1.global_variables())


def test_the_report_lists_state_moved_per_size_beside_the_measured_runs():
    args = options.parse_args(moe.EXPERIMENT, ["--find-max", "--device-memory", "64"] + TINY)
    trials = [dict(size=2, status="ok", peak_bytes=3 << 20), dict(size=4, status="oom")]
    summaries = [dict(system="tf", all_trials=trials),
                 dict(system="tfmem", all_trials=[dict(size=4, status="ok", peak_bytes=2 << 20)])]
    extra = moe.placement_report(args, summaries, "unused")
    rows = {row["experts"]: row for row in extra.data["placement"]}
    assert sorted(rows) == [2, 4]
    for experts, row in rows.items():
        # Every variable (weights, momentum slots) is state the pass moves; no large constants.
        assert round(_state_bytes(experts, args) / moe.MIB, 2) == row["moved_to_host_mib"]
    assert rows[4]["moved_to_host_mib"] > rows[2]["moved_to_host_mib"]
    assert rows[2]["tf peak MiB"] == 3.0 and rows[2]["tfmem status"] is None
    assert rows[4]["tfmem peak MiB"] == 2.0 and rows[4]["tf status"] == "oom"
    assert "moved_to_host_mib" in extra.markdown and "| 4 |" in extra.markdown
