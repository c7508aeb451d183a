"""A step out of device memory on an allocation the model never sized teaches that op.

An op whose output shape only the run knows (a tile by multiples a py_func returns) is
predicted to allocate nothing.  When its allocation fails, TensorFlow's error names the
op and the bytes: budget mode takes those bytes in as the op's scratch before any
factor, so the failed partition's prediction reaches what the device had for it while
every other partition keeps its prediction.  A factor alone would have to explain the
whole miss by scaling every working set (tests/test_updates_last.py runs this for real).
"""

from tfmem.cli import models
from tfmem.memory import budget, learning
from tfmem.memory.shapes import resolve_shapes
from tfmem.memory.sizing import Sizing
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan

MIB = 1 << 20


def _planned():
    model = models.mlp(layers=4)
    feed = model.feed(64)
    view = analyse([model.loss], [model.train], list(feed))
    plan = make_plan(view, 10)
    sizing = Sizing(resolve_shapes(model.graph, view, {t.name: v.shape for t, v in feed.items()}),
                    {})
    return plan, sizing, budget.predict(plan, sizing)


def _learn(unsized):
    plan, sizing, trace = _planned()
    index = max(range(len(trace.partitions)), key=lambda i: trace.partitions[i].device_peak)
    failed = trace.partitions[index]
    available = failed.device_peak + 8 * MIB  # it needed more than that
    op = plan.partitions[index].ops[-1]
    correction = budget.Correction()
    message = learning.learn_from_out_of_memory(
        correction, trace, index, available, None, {},
        lambda extra: budget.predict(plan, sizing, extra), run_again=True,
        unsized=(op, 9 * MIB) if unsized else None)
    corrected = budget.scaled(budget.predict(plan, sizing, correction.scratch),
                              correction.factor)
    return plan, op, index, available, trace, correction, corrected, message


def test_the_unsized_allocation_is_taken_in_as_the_op_s_scratch_not_as_a_factor():
    plan, op, index, available, trace, correction, corrected, message = _learn(unsized=True)
    assert correction.scratch == {op: 9 * MIB}
    assert correction.factor == 1.0
    assert corrected.partitions[index].device_peak_requested >= available
    others = [p.index for p in plan.partitions if op not in p.ops]
    assert others and all(corrected.partitions[i].device_peak == trace.partitions[i].device_peak
                          for i in others)
    assert repr(op) in message and "9.0 MiB" in message


def test_without_the_op_a_factor_scales_every_partition():
    _, _, index, available, trace, correction, corrected, _ = _learn(unsized=False)
    assert correction.scratch == {} and correction.factor > 1.0
    assert corrected.partitions[index].device_peak_requested >= available
    grown = [i for i, p in enumerate(trace.partitions)
             if corrected.partitions[i].device_peak > p.device_peak]
    assert len(grown) > 1

