"""Keras models for the Keras experiments and their tests (Keras 3, TensorFlow backend).

Three models a TensorFlow 2 user runs out of memory with, each built from a
seed so that two builds in two processes start from the same weights:

* `resnet50`: `keras.applications.ResNet50(weights=None)`, as a user takes it.
  It is not written in blocks a user could hand to `tf.recompute_grad`
  (`BLOCKS_OF_RESNET50` says why), so it has no recomputed-blocks variant.
* `unet3d`: a 3D U-Net (Conv3D + ReLU pairs, 3D max pooling, transposed
  convolutions, skip concatenations, a 1x1x1 softmax classifier per voxel).
* `transformer`: a Transformer encoder (token and position embeddings,
  `MultiHeadAttention`, feed-forward, layer norms) classifying every token.

The U-Net and the Transformer are written in blocks (`Block` layers): with
`recompute_blocks=True` every block runs under `tf.recompute_grad`, the way
its documentation asks a user to do it by hand (only the block's input and
output are kept for the backward pass).  Blocks hold no batch norm and no
dropout: a block's forward pass runs again in the backward pass, and batch
norm's moving-average updates would run twice, dropout draw another mask.

Keras is imported inside the builders: a parent process that only describes
an experiment must not start TensorFlow (the emulated cap is read when it
starts).
"""

import numpy as np

BLOCKS_OF_RESNET50 = (
    "keras.applications.ResNet50 is one functional graph of layers, not of blocks: "
    "tf.recompute_grad over its residual blocks would mean rewriting the model")


def _keras():
    import keras  # pylint: disable=import-outside-toplevel
    return keras


def block_layer_classes():
    """(Block, Recomputed): Keras layer classes, defined once Keras is imported."""
    global _CLASSES  # pylint: disable=global-statement
    if _CLASSES is None:
        _CLASSES = _define_block_classes(_keras())
    return _CLASSES


_CLASSES = None


def _define_block_classes(keras):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    class Block(keras.layers.Layer):
        """Layers applied in order to one input; no `training` argument (see the module
        docstring), so Keras's rematerialisation and tf.recompute_grad can wrap it."""

        def __init__(self, layers, **kwargs):
            super().__init__(**kwargs)
            self.inner = list(layers)

        def build(self, input_shape):
            shape = input_shape
            for layer in self.inner:
                layer.build(shape)
                shape = layer.compute_output_shape(shape)

        def call(self, inputs):
            for layer in self.inner:
                inputs = layer(inputs)
            return inputs

        def compute_output_shape(self, input_shape):
            for layer in self.inner:
                input_shape = layer.compute_output_shape(input_shape)
            return input_shape

    class Recomputed(keras.layers.Layer):
        """A layer whose forward pass runs again for its gradients (tf.recompute_grad)."""

        def __init__(self, inner, **kwargs):
            super().__init__(**kwargs)
            self.inner = inner

        def build(self, input_shape):
            self.inner.build(input_shape)

        def call(self, inputs):
            return tf.recompute_grad(lambda x: self.inner(x))(inputs)

        def compute_output_shape(self, input_shape):
            return self.inner.compute_output_shape(input_shape)

    return Block, Recomputed


def _blocked(block, recompute):
    _, recomputed = block_layer_classes()
    return recomputed(block, name=block.name + "_recomputed") if recompute else block


def _compile(model, learning_rate=1e-3):
    keras = _keras()
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(),
                  jit_compile=False)
    return model


def resnet50(image, classes=10, seed=0):
    """keras.applications.ResNet50 (weights=None) for image x image RGB inputs, Adam."""
    keras = _keras()
    keras.utils.set_random_seed(seed)
    model = keras.applications.ResNet50(weights=None, input_shape=(image, image, 3),
                                        classes=classes)
    return _compile(model)


def resnet50_data(batch, image, classes=10, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.standard_normal((batch, image, image, 3)).astype(np.float32),
            rng.randint(0, classes, batch).astype(np.int64))


def unet3d(side, filters=8, levels=3, classes=2, seed=0, recompute_blocks=False):
    """A 3D U-Net on side^3 one-channel volumes: `levels` resolutions, `filters` at the top
    doubling per level; each level a block of two 3x3x3 Conv3D + ReLU.  `side` must be a
    multiple of 2 ** (levels - 1)."""
    keras = _keras()
    block_class, _ = block_layer_classes()
    if side % 2 ** (levels - 1):
        raise ValueError(f"side must be a multiple of {2 ** (levels - 1)} for {levels} levels, "
                         f"got {side}")
    keras.utils.set_random_seed(seed)
    L = keras.layers

    def conv_block(channels, name):
        return _blocked(block_class([L.Conv3D(channels, 3, padding="same", activation="relu"),
                                     L.Conv3D(channels, 3, padding="same", activation="relu")],
                                    name=name), recompute_blocks)

    inputs = keras.Input((side, side, side, 1))
    h, skips = inputs, []
    for level in range(levels - 1):
        h = conv_block(filters * 2 ** level, f"down{level}")(h)
        skips.append(h)
        h = L.MaxPooling3D(2)(h)
    h = conv_block(filters * 2 ** (levels - 1), "bottom")(h)
    for level in reversed(range(levels - 1)):
        h = L.Conv3DTranspose(filters * 2 ** level, 2, strides=2)(h)
        h = L.Concatenate()([h, skips[level]])
        h = conv_block(filters * 2 ** level, f"up{level}")(h)
    outputs = L.Conv3D(classes, 1, activation="softmax")(h)
    return _compile(keras.Model(inputs, outputs, name="unet3d"))


def unet3d_data(batch, side, classes=2, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.standard_normal((batch, side, side, side, 1)).astype(np.float32),
            rng.randint(0, classes, (batch, side, side, side)).astype(np.int64))


def transformer(seq_len, d_model=64, heads=4, layers=2, ff=128, vocab=256, seed=0,
                recompute_blocks=False):
    """A Transformer encoder over `seq_len` tokens: `layers` blocks of self-attention
    (MultiHeadAttention) and feed-forward, each with a residual sum and a layer norm,
    then a per-token classifier over the vocabulary."""
    keras = _keras()
    block_class, _ = block_layer_classes()
    keras.utils.set_random_seed(seed)
    L = keras.layers

    class Residual(L.Layer):
        """x + f(x), then a layer norm (post-norm encoder)."""

        def __init__(self, inner, **kwargs):
            super().__init__(**kwargs)
            self.inner, self.norm = inner, L.LayerNormalization()

        def build(self, input_shape):
            self.inner.build(input_shape)
            self.norm.build(input_shape)

        def call(self, inputs):
            return self.norm(inputs + self.inner(inputs))

        def compute_output_shape(self, input_shape):
            return input_shape

    class SelfAttention(L.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.attention = L.MultiHeadAttention(heads, d_model // heads)

        def build(self, input_shape):
            self.attention.build(input_shape, input_shape)

        def call(self, inputs):
            return self.attention(inputs, inputs)

        def compute_output_shape(self, input_shape):
            return input_shape

    class PositionEmbedding(L.Layer):
        def build(self, input_shape):
            self.positions = self.add_weight(shape=(input_shape[-2], input_shape[-1]),
                                             initializer="glorot_uniform", name="positions")

        def call(self, inputs):
            return inputs + self.positions

    def encoder_block(index):
        feed_forward = block_class([L.Dense(ff, activation="relu"), L.Dense(d_model)],
                                   name=f"ff{index}")
        return _blocked(block_class([Residual(SelfAttention()), Residual(feed_forward)],
                                    name=f"encoder{index}"), recompute_blocks)

    inputs = keras.Input((seq_len,), dtype="int32")
    h = PositionEmbedding()(L.Embedding(vocab, d_model)(inputs))
    for index in range(layers):
        h = encoder_block(index)(h)
    outputs = L.Dense(vocab, activation="softmax")(h)
    return _compile(keras.Model(inputs, outputs, name="transformer"))


def transformer_data(batch, seq_len, vocab=256, seed=0):
    rng = np.random.RandomState(seed)
    return (rng.randint(0, vocab, (batch, seq_len)).astype(np.int32),
            rng.randint(0, vocab, (batch, seq_len)).astype(np.int64))


def state_bytes(model):
    """Bytes of the training state: weights, their gradients, the optimizer's variables."""
    weights = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    gradients = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    slots = sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables)
    return dict(weights=weights, gradients=gradients, optimizer=slots,
                total=weights + gradients + slots)
