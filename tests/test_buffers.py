"""Host buffers: aligned, reusable arrays, and a pool that stops allocating.

The pool (``tfs.host_buffers``) hands out 64-byte aligned numpy arrays,
takes them back and hands the same memory out again; a training loop whose
shapes repeat allocates nothing after its first step.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfmem
from tfmem.run.executing.buffers import HostBufferPool
from conftest import ATOL, RTOL, assert_same_result, build_convnet, build_mlp

tf1 = tf.compat.v1

ALIGN = 64


@pytest.fixture
def pool():
    p = HostBufferPool()
    yield p
    p.clear()


def _address(array):
    return array.__array_interface__["data"][0]


SHAPES = [
    ((), np.float32), ((1,), np.int8), ((3,), np.float64), ((7, 5), np.float32),
    ((2, 3, 4), np.int64), ((0,), np.float32), ((4, 0, 2), np.int32), ((33,), np.bool_),
    ((5, 5), np.complex128), ((1000,), np.uint8), ((3, 17), np.float16), ((65,), np.int8),
]


@pytest.mark.parametrize("shape, dtype", SHAPES)
def test_acquire_is_aligned_typed_and_writable(pool, shape, dtype):
    arr = pool.acquire(shape, dtype)
    assert isinstance(arr, np.ndarray)
    assert arr.shape == shape and arr.dtype == np.dtype(dtype)
    assert _address(arr) % ALIGN == 0
    assert arr.flags.writeable and arr.flags.c_contiguous and arr.flags.aligned
    values = (np.arange(arr.size) % 2).astype(dtype).reshape(shape)
    arr[...] = values
    np.testing.assert_array_equal(arr, values)
    pool.release(arr)
    assert pool.in_use_bytes == 0


def test_acquire_accepts_tf_style_arguments(pool):
    """The swap manager passes a fetched value's shape and dtype."""
    value = np.ones((3, 4), np.float32)
    arr = pool.acquire(value.shape, value.dtype)
    np.copyto(arr, value)
    assert arr.shape == (3, 4) and arr.dtype == np.float32
    arr2 = pool.acquire([2, 2], "int32")
    assert arr2.shape == (2, 2) and arr2.dtype == np.int32
    assert _address(arr2) % ALIGN == 0


def test_released_buffer_is_reused(pool):
    a = pool.acquire((10, 10), np.float32)
    address = _address(a)
    assert pool.allocations == 1
    pool.release(a)
    b = pool.acquire((10, 10), np.float32)
    assert _address(b) == address
    assert pool.allocations == 1
    # same byte size, other shape and dtype: the same block again
    pool.release(b)
    c = pool.acquire((50,), np.float64)
    assert _address(c) == address and c.shape == (50,) and c.dtype == np.float64
    assert pool.allocations == 1
    pool.release(c)


def test_buffers_in_use_are_distinct(pool):
    arrays = [pool.acquire((16,), np.float32) for _ in range(4)]
    arrays += [pool.acquire((3, 3), np.float64), pool.acquire((), np.int8)]
    ranges = sorted((_address(a), _address(a) + max(a.nbytes, 1)) for a in arrays)
    for (_, end), (start, _) in zip(ranges, ranges[1:]):
        assert end <= start, ranges
    for i, a in enumerate(arrays):
        a[...] = i
    for i, a in enumerate(arrays):
        assert np.all(a == i)
    assert pool.allocations == len(arrays)
    for a in arrays:
        pool.release(a)
    assert pool.in_use_bytes == 0
    # all free now: the same mix again allocates nothing
    again = [pool.acquire((16,), np.float32) for _ in range(4)]
    assert pool.allocations == len(arrays)
    assert {_address(a) for a in again} <= {start for start, _ in ranges}
    for a in again:
        pool.release(a)


def test_accounting(pool):
    assert (pool.allocations, pool.capacity_bytes, pool.in_use_bytes, pool.peak_in_use_bytes) == (0, 0, 0, 0)
    a = pool.acquire((100,), np.uint8)  # 100 bytes -> 128 of capacity
    b = pool.acquire((1,), np.uint8)  # at least the alignment
    assert pool.allocations == 2
    assert pool.capacity_bytes == pool.in_use_bytes
    assert pool.in_use_bytes >= 100 + 1
    assert pool.in_use_bytes % ALIGN == 0
    peak = pool.in_use_bytes
    pool.release(a)
    assert pool.in_use_bytes < peak
    assert pool.peak_in_use_bytes == peak
    pool.release(b)
    assert pool.in_use_bytes == 0
    assert pool.capacity_bytes == peak  # kept for reuse
    assert pool.peak_in_use_bytes == peak
    pool.clear()
    assert pool.capacity_bytes == 0 and pool.in_use_bytes == 0
    c = pool.acquire((100,), np.uint8)
    assert _address(c) % ALIGN == 0
    pool.release(c)


def test_not_pinned_without_gpu(pool, sessions):
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("a GPU is visible: buffers may be page-locked")
    assert pool.pinned is False
    g = tf.Graph()
    with g.as_default():
        tf.constant(1.0)
    tfs = tfmem.TFMemSession(sessions(g), partition_size=2)
    assert isinstance(tfs.host_buffers, HostBufferPool)
    assert tfs.host_buffers.pinned is False


# --------------------------------------------------------------------------
# the pool in a training loop


def _steps(tfs, model, first, count):
    losses = []
    for step in range(first, first + count):
        _, loss = tfs.run([model.train, model.loss], feed_dict=model.data[step % len(model.data)])
        losses.append(loss)
        pool = tfs.host_buffers
        assert pool.in_use_bytes == 0, f"step {step} left {pool.in_use_bytes} bytes of host buffers in use"
        assert tfs.last_step.host_buffer_bytes == pool.capacity_bytes
    return losses


@pytest.mark.parametrize("build, partition_size, prefetch", [
    (build_mlp, 3, 1), (build_mlp, 1, 0), (build_mlp, 4, 3), (build_convnet, 5, 2)],
    ids=["mlp-3-1", "mlp-1-0", "mlp-4-3", "convnet-5-2"])
def test_no_allocations_after_first_step(build, partition_size, prefetch, sessions):
    model = build()
    plain = sessions(model.graph)
    tfs = tfmem.TFMemSession(sessions(model.graph), partition_size=partition_size,
                             swap="all", prefetch=prefetch)
    plain.run(model.init)
    tfs.run(model.init)
    pool = tfs.host_buffers
    assert pool.allocations == 0

    losses = _steps(tfs, model, 0, 1)
    allocations, capacity = pool.allocations, pool.capacity_bytes
    assert allocations > 0 and capacity > 0
    assert tfs.last_step.swapped_out > 0
    # swapped tensors are released to the pool, so a step needs fewer blocks than swaps
    assert pool.peak_in_use_bytes <= capacity
    losses += _steps(tfs, model, 1, 5)
    assert pool.allocations == allocations, "the pool allocated again although shapes repeat"
    assert pool.capacity_bytes == capacity

    # and the buffers held the right values all along
    expected = [plain.run([model.train, model.loss], feed_dict=model.data[s % len(model.data)])[1]
                for s in range(6)]
    np.testing.assert_allclose(losses, expected, rtol=RTOL, atol=ATOL)
    assert_same_result(plain.run(model.weights), tfs.run(model.weights))


def test_new_batch_size_allocates_once_more(sessions):
    """A new shape may allocate; repeating it does not."""
    model = build_mlp("sgd")
    tfs = tfmem.TFMemSession(sessions(model.graph), partition_size=3, swap="all", prefetch=1)
    tfs.run(model.init)
    small = {model.x: model.data[0][model.x][:2], model.y: model.data[0][model.y][:2]}
    tfs.run([model.train, model.loss], feed_dict=small)
    tfs.run([model.train, model.loss], feed_dict=model.data[0])
    pool = tfs.host_buffers
    allocations = pool.allocations
    for step in range(3):
        tfs.run([model.train, model.loss], feed_dict=small)
        tfs.run([model.train, model.loss], feed_dict=model.data[step])
        assert pool.in_use_bytes == 0
    assert pool.allocations == allocations


def test_close_frees_buffers(sessions):
    model = build_mlp("sgd")
    tfs = tfmem.TFMemSession(sessions(model.graph), partition_size=3, swap="all")
    tfs.run(model.init)
    tfs.run([model.train, model.loss], feed_dict=model.data[0])
    pool = tfs.host_buffers
    assert pool.capacity_bytes > 0
    tfs.close()
    assert pool.capacity_bytes == 0 and pool.in_use_bytes == 0
