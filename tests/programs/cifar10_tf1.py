"""A CIFAR-10 tutorial-style TF1 training program, for tests that run a real
program through tfmem on both kernel paths.

    python cifar10_tf1.py [--steps N] [--partition-sizes 0,3,20]

It is written as TensorFlow's CIFAR-10 tutorial writes it: variables made by
`get_variable` pinned to /cpu:0 (resource variables), convolutions with
biases, local response normalisation, weight decay gathered in a collection,
an activation summary per layer plus histograms of every variable and
gradient, all merged and fetched each step, and an exponential moving average
of the losses applied under control dependencies of the training op.  Input is
fed.  A summary of a variable or an average reads it under a control
dependency on its update, so that its value is defined (the tutorial's reads
race with the updates, in plain TensorFlow too).  It trains once per partition size on a new graph, printing `run <N>`
first: with N > 0 the session is wrapped in
`tfmem.TFMemSession(sess, partition_size=N)`, with 0 it runs plainly.  Each
run prints one `loss <step> <value>` line and one `summary <step> <json>` line
per step: each summary value by tag, a scalar's value or a histogram's (min, max,
count, sum, sum of squares).
"""

import argparse
import json

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1
BATCH = 8
SIZE = 12
CLASSES = 10
CONFIG = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)


def _variable_on_cpu(name, shape, initializer):
    with tf.device("/cpu:0"):
        return tf1.get_variable(name, shape, initializer=initializer, dtype=tf.float32,
                                use_resource=True)


def _variable_with_weight_decay(name, shape, stddev, wd):
    var = _variable_on_cpu(name, shape, tf1.truncated_normal_initializer(stddev=stddev, seed=1))
    if wd:
        tf1.add_to_collection("losses", tf.multiply(tf.nn.l2_loss(var), wd, name="weight_loss"))
    return var


def _activation_summary(x):
    name = x.op.name
    tf1.summary.histogram(name + "/activations", x)
    tf1.summary.scalar(name + "/sparsity", tf.nn.zero_fraction(x))


def _conv(name, inputs, channels_in, channels_out):
    with tf1.variable_scope(name) as scope:
        kernel = _variable_with_weight_decay("weights", [3, 3, channels_in, channels_out],
                                             stddev=5e-2, wd=None)
        conv = tf.nn.conv2d(inputs, kernel, [1, 1, 1, 1], padding="SAME")
        biases = _variable_on_cpu("biases", [channels_out], tf1.constant_initializer(0.1))
        out = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
    _activation_summary(out)
    return out


def _local(name, inputs, width_in, width_out):
    with tf1.variable_scope(name) as scope:
        weights = _variable_with_weight_decay("weights", [width_in, width_out], stddev=0.04,
                                              wd=0.004)
        biases = _variable_on_cpu("biases", [width_out], tf1.constant_initializer(0.1))
        out = tf.nn.relu(tf.matmul(inputs, weights) + biases, name=scope.name)
    _activation_summary(out)
    return out


def inference(images):
    conv1 = _conv("conv1", images, 3, 16)
    pool1 = tf.nn.max_pool2d(conv1, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding="SAME",
                             name="pool1")
    norm1 = tf.nn.lrn(pool1, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm1")
    conv2 = _conv("conv2", norm1, 16, 16)
    norm2 = tf.nn.lrn(conv2, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm2")
    pool2 = tf.nn.max_pool2d(norm2, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding="SAME",
                             name="pool2")
    flat = tf.reshape(pool2, [BATCH, -1])
    local3 = _local("local3", flat, flat.shape[1], 48)
    local4 = _local("local4", local3, 48, 24)
    with tf1.variable_scope("softmax_linear") as scope:
        weights = _variable_with_weight_decay("weights", [24, CLASSES], stddev=1 / 24.0, wd=None)
        biases = _variable_on_cpu("biases", [CLASSES], tf1.constant_initializer(0.0))
        logits = tf.add(tf.matmul(local4, weights), biases, name=scope.name)
    _activation_summary(logits)
    return logits


def total_loss(logits, labels):
    cross_entropy = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits), name="cross_entropy")
    tf1.add_to_collection("losses", cross_entropy)
    return tf.add_n(tf1.get_collection("losses"), name="total_loss")


def _add_loss_summaries(loss):
    averages = tf1.train.ExponentialMovingAverage(0.9, name="avg")
    losses = tf1.get_collection("losses")
    averages_op = averages.apply(losses + [loss])
    for each in losses + [loss]:
        tf1.summary.scalar(each.op.name + "_raw", each)
        with tf.control_dependencies([averages_op]):  # the average after this step's update
            tf1.summary.scalar(each.op.name, tf.identity(averages.average(each)))
    return averages_op


def train(loss, global_step):
    learning_rate = tf1.train.exponential_decay(0.1, global_step, 10, 0.5, staircase=True)
    tf1.summary.scalar("learning_rate", learning_rate)
    loss_averages_op = _add_loss_summaries(loss)
    with tf.control_dependencies([loss_averages_op]):
        opt = tf1.train.GradientDescentOptimizer(learning_rate)
        grads = opt.compute_gradients(loss)
    apply_gradient_op = opt.apply_gradients(grads, global_step=global_step)
    with tf.control_dependencies([apply_gradient_op]):  # the variables after the update
        for var in tf1.trainable_variables():
            tf1.summary.histogram(var.op.name, tf.identity(var))
    for grad, var in grads:
        if grad is not None:
            tf1.summary.histogram(var.op.name + "/gradients", grad)
    variable_averages = tf1.train.ExponentialMovingAverage(0.999, global_step)
    with tf.control_dependencies([apply_gradient_op]):
        variables_averages_op = variable_averages.apply(tf1.trainable_variables())
    return variables_averages_op


def data(steps):
    rs = np.random.RandomState(3)
    images = rs.uniform(0, 1, (steps, BATCH, SIZE, SIZE, 3)).astype(np.float32)
    labels = rs.randint(0, CLASSES, (steps, BATCH)).astype(np.int32)
    return images, labels


def _summary_values(serialized):
    """{tag: [scalar] or [min, max, count, sum, sum of squares]} of a merged summary."""
    summary = tf1.Summary.FromString(serialized)
    values = {}
    for value in summary.value:
        if value.HasField("histo"):
            h = value.histo
            values[value.tag] = [h.min, h.max, h.num, h.sum, h.sum_squares]
        else:
            values[value.tag] = [value.simple_value]
    return values


def train_once(partition_size, steps):
    images, labels = data(steps)
    with tf.Graph().as_default():
        tf1.set_random_seed(0)
        global_step = tf1.train.get_or_create_global_step()
        x = tf1.placeholder(tf.float32, [BATCH, SIZE, SIZE, 3], name="images")
        y = tf1.placeholder(tf.int32, [BATCH], name="labels")
        loss = total_loss(inference(x), y)
        train_op = train(loss, global_step)
        summaries = tf1.summary.merge_all()
        sess = tf1.Session(config=CONFIG)
        sess.run(tf1.global_variables_initializer())
        if partition_size:
            import tfmem  # pylint: disable=import-outside-toplevel
            sess = tfmem.TFMemSession(sess, partition_size=partition_size)
        print(f"run {partition_size} summaries "
              f"{len(tf1.get_collection(tf1.GraphKeys.SUMMARIES))}", flush=True)
        for step in range(steps):
            _, value, summary = sess.run([train_op, loss, summaries],
                                         {x: images[step], y: labels[step]})
            print(f"loss {step} {value:.9e}", flush=True)
            print(f"summary {step} {json.dumps(_summary_values(summary))}", flush=True)
        sess.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--partition-sizes", default="0")
    args = parser.parse_args()
    tf1.disable_eager_execution()
    for size in args.partition_sizes.split(","):
        train_once(int(size), args.steps)


if __name__ == "__main__":
    main()
