"""TF2 training steps shared by the TF2 benchmarks (tools/bench_tf2.py,
tools/bench_peaks_tf2.py) and the tests of `tfmem.function`.

The builders take the `tf`, `np` and `keras` modules as arguments, so importing
this module starts no TensorFlow: a process sets its cap or kernel path first.
Each model is built from a seed, so that two builds start from the same weights.
"""


def build_resnet(keras, blocks, width=16, classes=10, seed=0):
    """A small Keras ResNet for 32x32x3 images (v1 blocks, seeded initialisers)."""
    layers = keras.layers
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32, 32, 3))
    h = layers.Conv2D(width, 3, padding="same", use_bias=False)(inputs)
    h = layers.ReLU()(layers.BatchNormalization()(h))
    for stage, count in enumerate(blocks):
        filters = width * 2 ** stage
        for block in range(count):
            stride = 2 if stage and not block else 1
            shortcut = h
            h = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(h)
            h = layers.ReLU()(layers.BatchNormalization()(h))
            h = layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
            h = layers.BatchNormalization()(h)
            if stride != 1 or shortcut.shape[-1] != filters:
                shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
            h = layers.ReLU()(layers.Add()([h, shortcut]))
    h = layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, layers.Dense(classes)(h))


def build_mlp(tf, np, seed, layers=8, width=256, batch=1024):
    """A small TF2 step without Keras, (step, x): an MLP of residual sines on plain
    variables, trained by hand-written SGD (the tests' model beside the Keras ResNet)."""
    rng = np.random.default_rng(seed)
    weights = [tf.Variable(rng.standard_normal((width, width)).astype(np.float32) * 0.05)
               for _ in range(layers)]

    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for w in weights:
                h = tf.nn.relu(h @ w)
                h = tf.sin(h) * 0.5 + h
            loss = tf.reduce_mean(h * h)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.01 * g)
        return loss
    x = tf.constant(np.random.default_rng(1).standard_normal((batch, width)).astype(np.float32))
    return step, x


def build_convnet(tf, np, seed, batch=32):
    """A TF2 convolution step without Keras, (step, variables, (x, y)): a stem and eight
    residual 16-channel 3x3 convolutions on 32x32 images, trained by hand-written SGD.
    With oneDNN off each convolution gradient allocates megabytes of im2col scratch
    (the tests of budget mode's learning rest on that)."""
    rng = np.random.default_rng(seed)
    stem = tf.Variable(rng.standard_normal((3, 3, 3, 16)).astype(np.float32) * 0.2)
    kernels = [tf.Variable(rng.standard_normal((3, 3, 16, 16)).astype(np.float32) * 0.15)
               for _ in range(8)]
    dense = tf.Variable(rng.standard_normal((16, 10)).astype(np.float32) * 0.1)
    variables = [stem] + kernels + [dense]

    def step(x, y):
        with tf.GradientTape() as tape:
            h = tf.nn.relu(tf.nn.conv2d(x, stem, 1, "SAME"))
            for k in kernels:
                h = tf.nn.relu(tf.nn.conv2d(h, k, 1, "SAME")) + h * 0.5
            logits = tf.reduce_mean(h, axis=[1, 2]) @ dense
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.05 * g)
        return loss
    r = np.random.default_rng(2)
    x = tf.constant(r.standard_normal((batch, 32, 32, 3)).astype(np.float32))
    y = tf.constant(r.integers(0, 10, batch).astype(np.int32))
    return step, variables, (x, y)


def convnext_block(keras, h, approximate=False):
    """One ConvNeXt block on `h`: depthwise 7x7 convolution, LayerNormalization, Dense to
    4x the channels with GELU (Keras's exact one, or its tanh approximation), Dense back,
    a learned per-channel layer scale, and the residual add."""
    layers = keras.layers

    class LayerScale(layers.Layer):
        def build(self, shape):
            self.gamma = self.add_weight(shape=(shape[-1],),
                                         initializer=keras.initializers.Constant(0.1))

        def call(self, x):
            return x * self.gamma

    channels = h.shape[-1]
    gelu = (lambda t: keras.activations.gelu(t, approximate=True)) if approximate else "gelu"
    block = layers.DepthwiseConv2D(7, padding="same")(h)
    block = layers.LayerNormalization(epsilon=1e-6)(block)
    block = layers.Dense(4 * channels, activation=gelu)(block)
    block = LayerScale()(layers.Dense(channels)(block))
    return layers.Add()([h, block])


def make_step(tf, keras, model, optimizer=None):
    """A custom training step: cross-entropy, `optimizer` (default SGD with momentum,
    built here), BN statistics updated."""
    optimizer = optimizer or keras.optimizers.SGD(0.01, momentum=0.9)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step
