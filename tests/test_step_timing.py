"""StepStats' timing of a step's calls (tools/bench.py's per-partition overhead reads it):
`call_time` inside the partitions' calls, `uploads` / `upload_time` on the prefetch thread.

Both front ends run one step loop (`tfmem.run.executing.step_loop`), so both fill them the same way.
No timing is asserted beyond what must hold: the calls run inside the step.
"""

import numpy as np
import tensorflow as tf

import tfmem
from tfmem.plan.schedule import Schedule

from conftest import assert_same_result, build_mlp, new_session


def _upload_batches(plan):
    """The upload calls one step of `plan` makes: one per partition where spans start."""
    return sum(1 for keys in Schedule(plan).uploads if keys)


def _check_timing(stats, plan):
    assert 0 < stats.call_time <= stats.wall_time
    assert stats.uploads == _upload_batches(plan) > 0
    assert 0 < stats.upload_time
    assert stats.swapped_in >= stats.uploads  # a batch uploads one or more tensors


def test_session_steps_report_their_call_and_upload_times():
    model = build_mlp()
    plain = new_session(model.graph)
    tfs = tfmem.TFMemSession(new_session(model.graph), partition_size=6, swap="all",
                             options=tfmem.Options(swap_min_bytes=0))
    plain.run(model.init)
    tfs.run(model.init)
    fetches = [model.loss, model.train]
    for feed in model.data[:2]:
        assert_same_result(plain.run(fetches, feed), tfs.run(fetches, feed))
        _check_timing(tfs.last_step, tfs.plan(fetches, feed))
    no_swaps = tfmem.TFMemSession(tfs.session, partition_size=6, swap="none")
    no_swaps.run(model.loss, model.data[2])
    assert no_swaps.last_step.uploads == 0 and no_swaps.last_step.upload_time == 0.0
    assert 0 < no_swaps.last_step.call_time <= no_swaps.last_step.wall_time
    tfs.close()
    plain.close()


def test_function_steps_report_their_call_and_upload_times():
    rng = np.random.default_rng(0)
    weights = [tf.Variable(rng.standard_normal((16, 16)).astype(np.float32) * 0.3)
               for _ in range(4)]

    def step(x):
        for w in weights:
            x = tf.sin(x @ w) + x
        return tf.reduce_sum(x * x)

    partitioned = tfmem.function(step, partition_size=2, swap="all",
                                 options=tfmem.Options(swap_min_bytes=0))
    x = tf.constant(rng.standard_normal((8, 16)).astype(np.float32))
    np.testing.assert_allclose(partitioned(x).numpy(), tf.function(step)(x).numpy(), rtol=1e-5)
    _check_timing(partitioned.last_step, partitioned.plan(x))
