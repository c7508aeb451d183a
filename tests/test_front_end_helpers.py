"""The helpers both front ends share: the partition size check, the budget lookup and the
planning GC pause (tfmem.TFMemSession and tfmem.function must answer alike)."""

import gc

import pytest
import tensorflow as tf

import tfmem
from tfmem.plan.gc_pause import gc_paused


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "200", None])
def test_both_front_ends_refuse_the_same_partition_sizes(bad):
    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0)
    with tf.compat.v1.Session(graph=graph) as sess:
        with pytest.raises(ValueError, match="partition_size must be a positive integer") as s:
            tfmem.TFMemSession(sess, partition_size=bad)
    with pytest.raises(ValueError, match="partition_size must be a positive integer") as f:
        tfmem.function(lambda x: x, partition_size=bad)
    assert str(s.value) == str(f.value) and repr(bad) in str(s.value)


def test_budget_mode_without_a_budget_or_device_memory_is_refused_alike(monkeypatch):
    monkeypatch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", raising=False)
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0)
    with tf.compat.v1.Session(graph=graph) as sess:
        with pytest.raises(ValueError, match="needs a device_memory_budget") as s:
            tfmem.TFMemSession(sess, partition_size="auto")
        assert tfmem.TFMemSession(sess, device_memory_budget="1MiB").partition_size == "auto"
    step = tfmem.function(lambda x: x * 2.0, partition_size="auto")
    with pytest.raises(ValueError, match="needs a device_memory_budget") as f:
        step(tf.constant(1.0))
    assert str(s.value) == str(f.value)


def test_gc_pause_restores_the_collector_as_it_found_it():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            assert not gc.isenabled()
            with gc_paused():  # nested: the outer pause re-enables, not the inner
                pass
            assert not gc.isenabled()
            raise RuntimeError("planning failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # the caller had it off: it stays off
    finally:
        gc.enable()
