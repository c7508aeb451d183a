"""ResNet: how deep a network trains under an emulated device-memory cap.

A CIFAR-style ResNet built from TensorFlow ops in graph mode (no Keras):
a 3x3 stem convolution, three stages of basic residual blocks (two 3x3
convolutions, each followed by batch normalisation, ReLU after the first and
after the residual sum; a strided 3x3 projection where the shape changes)
with `width`, 2 `width` and 4 `width` channels, global average pooling and a
dense softmax classifier, trained with momentum SGD.  Batch normalisation is
TensorFlow's fused kernel in training mode, and its moving mean and variance
are updated by assign ops in the UPDATE_OPS collection, on which the train op
depends (the usual graph-mode pattern).

The depth grows the way the paper grows it: only the third stage deepens.

    --layers L  ->  stage blocks (1, 1, n3) with n3 = (L - 6) / 2
                    (L = 2 * (1 + 1 + n3) + 2: the stem, two convolutions per
                    block, the classifier; projections are not counted)

so L is even and at least 8: ResNet-8 is (1, 1, 1), ResNet-56 is (1, 1, 25).

    python experiments/resnet.py --system tfmem --layers 56 --device-memory 96
    python experiments/resnet.py --find-max --device-memory 128
    python experiments/resnet.py --quick
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: import from the root

from experiments.harness.experiment import Experiment, Model
from experiments.harness.main import main
from experiments.harness.options import positive_int

FIXED_STAGES = (1, 1)  # blocks of the first two stages; the third grows


def layers_of(n3):
    """Depth of the network whose third stage has n3 blocks."""
    return 2 * (sum(FIXED_STAGES) + n3) + 2


def blocks_of(layers):
    """Blocks of the third stage for a depth; ValueError for depths that do not exist."""
    n3, odd = divmod(layers - 2 - 2 * sum(FIXED_STAGES), 2)
    if odd or n3 < 1:
        raise ValueError(f"--layers must be even and at least {layers_of(1)} "
                         f"(2 * (1 + 1 + n3) + 2), got {layers}")
    return n3


def parameters(layers, width=16, classes=10):
    """Trainable parameters of the network (without building it)."""
    total, channels = 9 * 3 * width + 2 * width, width
    for stage, blocks in enumerate(FIXED_STAGES + (blocks_of(layers),)):
        out = width * 2 ** stage
        for block in range(blocks):
            total += 9 * channels * out + 9 * out * out + 4 * out
            if channels != out:
                total += 9 * channels * out
            channels = out
    return total + channels * classes


def build(tf, layers, args):
    """The ResNet training step in a new graph (see the module docstring)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    width, image, classes, seed = args.width, args.image, args.classes, args.seed
    batch = args.batch_size
    graph = tf.Graph()
    counter = [seed]

    def conv(x, channels, stride, name):
        counter[0] += 1
        kernel = tf1.get_variable(name, [3, 3, x.shape[-1], channels],
                                  initializer=tf1.glorot_uniform_initializer(seed=counter[0]))
        return tf.nn.conv2d(x, kernel, strides=stride, padding="SAME")

    def batch_norm(x, name):
        channels = x.shape[-1]
        with tf1.variable_scope(name):
            gamma = tf1.get_variable("gamma", [channels], initializer=tf1.ones_initializer())
            beta = tf1.get_variable("beta", [channels], initializer=tf1.zeros_initializer())
            moving_mean = tf1.get_variable("moving_mean", [channels], trainable=False,
                                           initializer=tf1.zeros_initializer())
            moving_var = tf1.get_variable("moving_variance", [channels], trainable=False,
                                          initializer=tf1.ones_initializer())
            y, mean, variance = tf1.nn.fused_batch_norm(x, gamma, beta, epsilon=1e-5,
                                                        is_training=True)
            for var, value in ((moving_mean, mean), (moving_var, variance)):
                tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                                      tf1.assign(var, 0.9 * var + 0.1 * value))
            return y

    with graph.as_default():
        images = tf1.placeholder(tf.float32, [batch, image, image, 3], name="images")
        labels = tf1.placeholder(tf.int64, [batch], name="labels")
        h = tf.nn.relu(batch_norm(conv(images, width, 1, "stem"), "stem_bn"))
        for stage, blocks in enumerate(FIXED_STAGES + (blocks_of(layers),)):
            channels = width * 2 ** stage
            for block in range(blocks):
                stride = 2 if stage and block == 0 else 1
                with tf1.variable_scope(f"stage{stage + 1}/block{block + 1}"):
                    out = tf.nn.relu(batch_norm(conv(h, channels, stride, "conv1"), "bn1"))
                    out = batch_norm(conv(out, channels, 1, "conv2"), "bn2")
                    if stride != 1 or h.shape[-1] != channels:
                        h = conv(h, channels, stride, "projection")
                    h = tf.nn.relu(out + h)
        pooled = tf.reduce_mean(h, [1, 2])
        dense = tf1.get_variable("classifier", [pooled.shape[-1], classes],
                                 initializer=tf1.glorot_uniform_initializer(seed=seed))
        logits = tf.matmul(pooled, dense)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits), name="loss")
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            train_op = tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train")
        init = tf1.global_variables_initializer()
        count = sum(v.shape.num_elements() for v in tf1.trainable_variables())
    rng = np.random.RandomState(seed)
    feed = {images: rng.standard_normal((batch, image, image, 3)).astype(np.float32),
            labels: rng.randint(0, classes, batch).astype(np.int64)}
    return Model(graph, loss, train_op, init, feed, count, batch)


def add_arguments(group):
    group.add_argument("--width", type=positive_int,
                       help="channels of the first stage (then 2x, 4x; default 16)")
    group.add_argument("--image", type=positive_int,
                       help="image side in pixels (default 64)")
    group.add_argument("--classes", type=positive_int,
                       help="(default 10)")
    group.add_argument("--seed", type=int, help="(default 0)")


EXPERIMENT = Experiment(
    name="resnet",
    title="ResNet (graph mode, third stage deepened)",
    size="layers",
    size_help="depth L (even, >= 8): stage blocks (1, 1, (L - 6) / 2)",
    sizes=layers_of,
    index_of=blocks_of,
    build=build,
    script=__file__,
    add_arguments=add_arguments,
    model_args=("width", "image", "classes", "seed"),
    defaults=dict(width=16, image=64, classes=10, seed=0, batch_size=16,
                  trial_timeout=600.0),
    # --quick caps the device at plain TensorFlow's peak at 16 layers, measured on the
    # machine at hand (the kernel path moves it: convolution scratch buffers).
    # The searches start there (plain TensorFlow fits it by construction).
    quick=dict(cap_base=16, start=16, batch_size=16, max_steps=12, trial_timeout=60.0,
               tolerance=0.1, search_time=240.0),
    unit="images",
    work_unit="layer-image",
)


if __name__ == "__main__":
    raise SystemExit(main(EXPERIMENT))
