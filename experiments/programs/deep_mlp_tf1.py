"""An unmodified TF1-style training script whose step needs more memory than a
small accelerator has; experiments/programs.md runs it plainly and through
`tfmem run` under an emulated cap.  It knows nothing about tfmem.

    python deep_mlp_tf1.py [--steps 5] [--layers 24] [--batch 1024] [--dropout 0]
"""

import argparse

import numpy as np
import tensorflow as tf

tf1 = tf.compat.v1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--dataset", action="store_true", help="feed from tf.data, not feed_dict")
    args = parser.parse_args()
    tf1.disable_eager_execution()
    rs = np.random.RandomState(0)
    data = rs.standard_normal((args.batch * 2, args.width)).astype(np.float32)
    if args.dataset:
        dataset = tf.data.Dataset.from_tensor_slices(data).batch(args.batch).repeat()
        x = tf1.data.make_one_shot_iterator(dataset).get_next()
    else:
        x = tf1.placeholder(tf.float32, [None, args.width])
    h = x
    for i in range(args.layers):
        w = tf1.Variable((rs.standard_normal((args.width, args.width)) / np.sqrt(args.width))
                         .astype(np.float32), name=f"w{i}")
        h = tf.nn.relu(tf.matmul(h, w))
        h = tf.sin(h) * 0.5 + h
        if args.dropout:
            h = tf1.nn.dropout(h, rate=args.dropout, seed=i)
    loss = tf.reduce_mean(tf.square(h))
    tf1.set_random_seed(0)
    train = tf1.train.GradientDescentOptimizer(0.01).minimize(loss)
    config = tf1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    with tf1.Session(config=config) as sess:
        sess.run(tf1.global_variables_initializer())
        for step in range(args.steps):
            feed = {} if args.dataset else {x: data[(step % 2) * args.batch:][:args.batch]}
            _, value = sess.run([train, loss], feed)
            print(f"loss {step} {value:.9e}", flush=True)


if __name__ == "__main__":
    main()
