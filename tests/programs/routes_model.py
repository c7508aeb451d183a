"""Model code a program imports, written as tf_upgrade_v2 writes TF1 code."""

import numpy as np
import tensorflow.compat.v1 as tf


def model():
    """(x, loss, train, init) of a small deep tanh net, in the default graph."""
    x = tf.placeholder(tf.float32, [4, 3], name="x")
    w = tf.Variable(np.linspace(-1, 1, 9, dtype=np.float32).reshape(3, 3), name="w")
    h = x
    for _ in range(6):
        h = tf.tanh(tf.matmul(h, w))
    loss = tf.reduce_sum(h * h, name="loss")
    train = tf.train.GradientDescentOptimizer(0.1).minimize(loss)
    return x, loss, train, tf.global_variables_initializer()


def new_session():
    return tf.Session()
