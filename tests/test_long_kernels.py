"""Small ops run beside a long kernel on a second inter-op thread.

While one thread runs a matrix product, the other runs the partition's branch of
small elementwise ops to its end; their results (held to the partition's end)
are all alive when the long branch reaches its peak.  Taking turns op by op, as
if every kernel took as long, puts most of them after that peak.  Keras Adam on
ResNet-50 is such a partition: its thousands of update ops run beside the last
convolution gradients.

One fresh process per kernel path, two inter-op threads, one intra-op thread, a
BFC allocator far above the step: tfmem.function's prediction for one partition
is set against TensorFlow's peak of the same steps.
"""

import pytest

from conftest import one_partition_peak

MIB = 1 << 20

BODY = """
def body(m, v):
    # the long branch first (lower node ids): four 1024 x 1024 products, then a 32 MiB tile
    h = m
    for _ in range(4):
        h = tf.matmul(h, m)
    total = tf.reduce_sum(tf.tile(h, [8, 1]))
    # forty small results of 0.5 MiB each, returned: held to the end
    return total, [tf.sin(v + float(i)) for i in range(40)]
"""


@pytest.mark.parametrize("onednn", [False, True])
def test_small_ops_beside_a_long_kernel_stay_within_the_prediction(onednn):
    figures = one_partition_peak(BODY, onednn)
    assert figures["partitions"] == 1
    # the forty small results (20 MiB) beside the tile (32 MiB) and a product (4 MiB)
    assert figures["measured"] > 52 * MIB
    # TensorFlow's in-use figure counts chunks, some handed out larger than their request
    assert figures["measured"] <= figures["chunks"]
