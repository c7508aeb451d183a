"""Small graph-mode models (TensorFlow ops, no Keras) for tests, benchmarks and experiments.

Each builder returns a `Model`: its graph, input placeholders, loss, train op
and initializer, with variables drawn from seeded random initializers (numpy
constants would be cached by their kernels and dominate memory), plus
`feed(batch)` for seeded synthetic data.
"""

import dataclasses

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


@dataclasses.dataclass
class Model:
    graph: tf.Graph
    inputs: tuple
    loss: tf.Tensor
    train: tf.Operation
    init: tf.Operation
    feed: object  # callable(batch_size, seed) -> feed_dict


def _finish(graph, inputs, loss, learning_rate, feed):
    with graph.as_default():
        train = tf1.train.MomentumOptimizer(learning_rate, 0.9).minimize(loss)
        init = tf1.global_variables_initializer()
    return Model(graph, inputs, loss, train, init, feed)


def mlp_layers(h, layers, width, seed):
    """`layers` times `h = relu(h @ w{i}); h = sin(h) * 0.5 + h` (resource variables,
    Glorot-uniform with seed + i): the MLP of `mlp` and of the memory proof."""
    for i in range(layers):
        w = tf1.get_variable(f"w{i}", [h.shape[1], width], use_resource=True,
                             initializer=tf1.glorot_uniform_initializer(seed=seed + i))
        h = tf.nn.relu(tf.matmul(h, w))
        h = tf.sin(h) * 0.5 + h
    return h


def mlp(layers=8, width=256, features=256, seed=0):
    """A deep MLP whose step memory is mostly activations."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, features], name="x")
        loss = tf.reduce_mean(mlp_layers(x, layers, width, seed) ** 2)

    def feed(batch, data_seed=0):
        return {x: np.random.RandomState(data_seed).randn(batch, features).astype(np.float32)}
    return _finish(g, (x,), loss, 0.01, feed)


def _conv(x, channels, stride, name, seed):
    w = tf1.get_variable(name, [3, 3, x.shape[-1], channels],
                         initializer=tf1.glorot_uniform_initializer(seed=seed))
    return tf.nn.conv2d(x, w, strides=stride, padding="SAME")


def _batch_norm(x, name):
    """Batch statistics with moving averages updated through UPDATE_OPS."""
    channels = x.shape[-1]
    with tf1.variable_scope(name):
        gamma = tf1.get_variable("gamma", [channels], initializer=tf1.ones_initializer())
        beta = tf1.get_variable("beta", [channels], initializer=tf1.zeros_initializer())
        moving = tf1.get_variable("moving_mean", [channels], trainable=False,
                                  initializer=tf1.zeros_initializer())
        mean, variance = tf.nn.moments(x, [0, 1, 2])
        tf1.add_to_collection(tf1.GraphKeys.UPDATE_OPS,
                              tf1.assign(moving, 0.9 * moving + 0.1 * mean))
        return tf.nn.batch_normalization(x, mean, variance, beta, gamma, 1e-5)


def resnet(blocks=(2, 2, 2), width=16, image=32, classes=10, seed=0):
    """A CIFAR-style ResNet: three stages of basic blocks (depth = 6 * n + 2 for n blocks each)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, image, image, 3], name="images")
        y = tf1.placeholder(tf.int64, [None], name="labels")
        h = tf.nn.relu(_batch_norm(_conv(x, width, 1, "stem", seed), "stem_bn"))
        count = 0
        for stage, n in enumerate(blocks):
            channels = width * 2 ** stage
            for block in range(n):
                stride = 2 if stage and block == 0 else 1
                with tf1.variable_scope(f"s{stage}b{block}"):
                    out = tf.nn.relu(_batch_norm(_conv(h, channels, stride, "c1", seed + count),
                                                 "bn1"))
                    out = _batch_norm(_conv(out, channels, 1, "c2", seed + count + 1), "bn2")
                    if stride != 1 or h.shape[-1] != channels:
                        h = _conv(h, channels, stride, "proj", seed + count + 2)
                    h = tf.nn.relu(out + h)
                count += 3
        pooled = tf.reduce_mean(h, [1, 2])
        w = tf1.get_variable("fc", [pooled.shape[-1], classes],
                             initializer=tf1.glorot_uniform_initializer(seed=seed))
        logits = tf.matmul(pooled, w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))
        with tf.control_dependencies(tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)):
            loss = tf.identity(loss)

    def feed(batch, data_seed=0):
        rng = np.random.RandomState(data_seed)
        return {x: rng.randn(batch, image, image, 3).astype(np.float32),
                y: rng.randint(0, classes, batch)}
    return _finish(g, (x, y), loss, 0.05, feed)


def unrolled_rnn(steps=32, features=64, hidden=128, classes=16, seed=0):
    """A statically unrolled bidirectional tanh RNN over `steps` time steps."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, steps, features], name="sequence")
        y = tf1.placeholder(tf.int64, [None], name="labels")
        outputs = []
        for direction in ("fw", "bw"):
            with tf1.variable_scope(direction):
                wx = tf1.get_variable("wx", [features, hidden],
                                      initializer=tf1.glorot_uniform_initializer(seed=seed))
                wh = tf1.get_variable("wh", [hidden, hidden],
                                      initializer=tf1.orthogonal_initializer(seed=seed + 1))
                order = range(steps) if direction == "fw" else reversed(range(steps))
                state = tf.zeros_like(tf.matmul(x[:, 0, :], wx))
                for t in order:
                    state = tf.tanh(tf.matmul(x[:, t, :], wx) + tf.matmul(state, wh))
                outputs.append(state)
        w = tf1.get_variable("out", [2 * hidden, classes],
                             initializer=tf1.glorot_uniform_initializer(seed=seed + 2))
        logits = tf.matmul(tf.concat(outputs, 1), w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=logits))

    def feed(batch, data_seed=0):
        rng = np.random.RandomState(data_seed)
        return {x: rng.randn(batch, steps, features).astype(np.float32),
                y: rng.randint(0, classes, batch)}
    return _finish(g, (x, y), loss, 0.01, feed)


def moe(experts=8, d_model=64, hidden=128, tokens=64, top_k=2, classes=16, seed=0):
    """A mixture-of-experts layer with top-k gating and dense dispatch, on a dense stem.

    Every expert runs on every token; the gate's top-k weights (zero elsewhere)
    combine their outputs, as TensorFlowMem's MoE layers do without a sparse
    dispatcher.
    """
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, tokens, d_model], name="tokens")
        y = tf1.placeholder(tf.int64, [None], name="labels")
        flat = tf.reshape(x, [-1, d_model])
        init = tf1.glorot_uniform_initializer
        gate_w = tf1.get_variable("gate", [d_model, experts], initializer=init(seed=seed))
        logits = tf.matmul(flat, gate_w)
        top, index = tf.nn.top_k(logits, top_k)
        threshold = top[:, -1:]
        weights = tf.nn.softmax(tf.where(logits >= threshold, logits,
                                         tf.fill(tf.shape(logits), -1e9)))
        mixed = 0.0
        for e in range(experts):
            w1 = tf1.get_variable(f"e{e}/w1", [d_model, hidden], initializer=init(seed=seed + e))
            w2 = tf1.get_variable(f"e{e}/w2", [hidden, d_model],
                                  initializer=init(seed=seed + 100 + e))
            out = tf.matmul(tf.nn.relu(tf.matmul(flat, w1)), w2)
            mixed = mixed + weights[:, e:e + 1] * out
        h = tf.reshape(mixed + flat, [-1, tokens, d_model])
        pooled = tf.reduce_mean(h, 1)
        w = tf1.get_variable("out", [d_model, classes], initializer=init(seed=seed + 1))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(pooled, w)))

    def feed(batch, data_seed=0):
        rng = np.random.RandomState(data_seed)
        return {x: rng.randn(batch, tokens, d_model).astype(np.float32),
                y: rng.randint(0, classes, batch)}
    return _finish(g, (x, y), loss, 0.01, feed)


def _dense_classifier_loss(h, labels, classes, seed):
    """Mean softmax cross-entropy of one dense layer from the flattened `h` to `classes`."""
    flat = tf.reshape(h, [-1, int(np.prod(h.shape[1:]))])
    w = tf1.get_variable("fc", [flat.shape[-1], classes],
                         initializer=tf1.glorot_uniform_initializer(seed=seed))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=tf.matmul(flat, w)))


def _image_feed(x, y, image, classes):
    """feed(batch, data_seed): seeded random images and labels for `x` and `y`."""
    def feed(batch, data_seed=0):
        rng = np.random.RandomState(data_seed)
        return {x: rng.randn(batch, image, image, 3).astype(np.float32),
                y: rng.randint(0, classes, batch)}
    return feed


def convnet(channels=(13, 29, 47), image=36, strides=(1, 2, 1), kernel=(5, 3, 3),
            pool="max", classes=10, seed=0):
    """A plain convolution net of odd shapes the simulator was not tuned on: odd channel
    counts and image size, a strided layer, 5x5 and 3x3 kernels, VALID padding on the
    first layer, and a 2x2 pooling (max or average) after each layer."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, image, image, 3], name="images")
        y = tf1.placeholder(tf.int64, [None], name="labels")
        h = x
        pooling = tf.nn.max_pool2d if pool == "max" else tf.nn.avg_pool2d
        for i, (width, stride, size) in enumerate(zip(channels, strides, kernel)):
            w = tf1.get_variable(f"conv{i}", [size, size, h.shape[-1], width],
                                 initializer=tf1.glorot_uniform_initializer(seed=seed + i))
            h = tf.nn.relu(tf.nn.conv2d(h, w, strides=stride,
                                        padding="VALID" if i == 0 else "SAME"))
            h = pooling(h, 2, 2, "SAME")
        loss = _dense_classifier_loss(h, y, classes, seed)
    return _finish(g, (x, y), loss, 0.05, _image_feed(x, y, image, classes))


def vgg(widths=(24, 24, 40, 40, 72, 72), image=48, classes=10, seed=0):
    """A VGG-like net: 3x3 convolutions with biases and ReLU, a 2x2 max pooling after each
    pair, a dense layer to `classes` logits (oneDNN fuses each convolution, bias and ReLU
    into one kernel, and its pooling gradients allocate scratch before their outputs)."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, image, image, 3], name="images")
        y = tf1.placeholder(tf.int64, [None], name="labels")
        h = x
        for i, width in enumerate(widths):
            w = tf1.get_variable(f"conv{i}", [3, 3, h.shape[-1], width],
                                 initializer=tf1.glorot_uniform_initializer(seed=seed + i))
            b = tf1.get_variable(f"bias{i}", [width], initializer=tf1.zeros_initializer())
            h = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(h, w, 1, "SAME"), b))
            if i % 2 == 1:
                h = tf.nn.max_pool2d(h, 2, 2, "SAME")
        loss = _dense_classifier_loss(h, y, classes, seed)
    return _finish(g, (x, y), loss, 0.05, _image_feed(x, y, image, classes))
