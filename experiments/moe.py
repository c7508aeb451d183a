"""Mixture of experts: how many experts per layer train under an emulated device-memory cap.

A Transformer encoder built from TensorFlow ops in graph mode (no Keras):
token and learned position embeddings, then `--layers` encoder layers, each
multi-head self-attention and a Mixture-of-Experts feed-forward layer (both
with a residual sum and layer normalisation after it), a dense softmax
classifier per token, trained with momentum SGD.  The task is synthetic token
classification: every token's label is a fixed function of the token
((7 t + 3) mod vocab), so the loss falls as it trains.

The MoE layer (Shazeer et al. 2017, the model of the paper's MoE table):
a softmax gate over the experts per token keeps its top `--top-k` weights
(renormalised, the rest zero); each expert is a two-layer ReLU network
(d_model -> d_ff -> d_model, no biases) with its own two weight matrices; the layer's output is
the sum of the experts' outputs weighted by the gate.  Dispatch is dense:
every expert runs on every token and the gate's zeros mask the tokens not
routed to it.  That costs compute, but it makes activations, not only
parameters, grow with the number of experts, which is what the paper's
table measures (memory at a fixed batch).  No single op reads every
expert's output: the weighted sum is a running sum, and the gradients of the
input every expert reads are summed pairwise
(`AggregationMethod.EXPERIMENTAL_TREE`) instead of by one AddN.  Both
systems train the same graph.

Sizes: 2 layers, d_model 64, 4 heads, experts of 128 hidden units, 128
tokens per sentence, vocabulary 256.  Longer sentences than the usual toy
size on purpose: an expert's activations grow with the tokens, its state
(weights and momentum) does not, and on an emulated device the state cannot
leave, so the tokens decide how far swapping activations can go.

    --experts E: experts per MoE layer (every layer has E)

    python experiments/moe.py --system tfmem --experts 48 --device-memory 40
    python experiments/moe.py --find-max --device-memory 64
    python experiments/moe.py --quick
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: import from the root

from experiments.harness.experiment import Experiment, Extra, Model
from experiments.harness.main import main
from experiments.harness.options import positive_int


def experts_of(experts):
    """The search index of a number of experts (the number itself); ValueError if < 1."""
    if experts < 1:
        raise ValueError(f"--experts must be at least 1, got {experts}")
    return experts


def parameters(experts, layers=2, d_model=64, d_ff=128, vocab=256, seq_len=128):
    """Trainable parameters of the model (without building it)."""
    norm = 2 * d_model
    attention = 4 * d_model * d_model
    expert = 2 * d_model * d_ff
    layer = attention + norm + d_model * experts + experts * expert + norm
    return vocab * d_model + seq_len * d_model + layers * layer + d_model * vocab + vocab


def build(tf, experts, args):
    """The MoE Transformer training step in a new graph (see the module docstring)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    batch, seq, d_model, d_ff = args.batch_size, args.seq_len, args.d_model, args.d_ff
    heads, vocab, top_k, seed = args.heads, args.vocab, min(args.top_k, experts), args.seed
    if d_model % heads:
        raise ValueError(f"--d-model ({d_model}) must be a multiple of --heads ({heads})")
    graph = tf.Graph()
    counter = [seed]

    def weight(name, shape):
        counter[0] += 1
        return tf1.get_variable(name, shape,
                                initializer=tf1.glorot_uniform_initializer(seed=counter[0]))

    def layer_norm(x, name):
        with tf1.variable_scope(name):
            gamma = tf1.get_variable("gamma", [d_model], initializer=tf1.ones_initializer())
            beta = tf1.get_variable("beta", [d_model], initializer=tf1.zeros_initializer())
            mean, variance = tf.nn.moments(x, [-1], keepdims=True)
            return (x - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta

    def attention(x):  # x: [batch * seq, d_model]
        depth = d_model // heads

        def split(t):  # -> [batch, heads, seq, depth]
            return tf.transpose(tf.reshape(t, [batch, seq, heads, depth]), [0, 2, 1, 3])

        q, k, v = (split(tf.matmul(x, weight(n, [d_model, d_model]))) for n in "qkv")
        scores = tf.matmul(q, k, transpose_b=True) / float(depth) ** 0.5
        mixed = tf.matmul(tf.nn.softmax(scores), v)
        mixed = tf.reshape(tf.transpose(mixed, [0, 2, 1, 3]), [batch * seq, d_model])
        return tf.matmul(mixed, weight("o", [d_model, d_model]))

    def mixture(x):  # x: [tokens, d_model]
        probs = tf.nn.softmax(tf.matmul(x, weight("gate", [d_model, experts])))
        kth = tf.stop_gradient(tf.math.top_k(probs, top_k).values[:, -1:])
        kept = probs * tf.cast(probs >= kth, probs.dtype)
        gates = tf.unstack(kept / tf.reduce_sum(kept, -1, keepdims=True), axis=-1)
        out = None
        for e, gate in enumerate(gates):
            with tf1.variable_scope(f"expert{e}"):
                hidden = tf.nn.relu(tf.matmul(x, weight("w1", [d_model, d_ff])))
                y = tf.matmul(hidden, weight("w2", [d_ff, d_model])) * gate[:, None]
            out = y if out is None else out + y
        return out

    with graph.as_default():
        tokens = tf1.placeholder(tf.int64, [batch, seq], name="tokens")
        labels = tf1.placeholder(tf.int64, [batch, seq], name="labels")
        embedded = tf.gather(weight("embedding", [vocab, d_model]), tokens)
        h = tf.reshape(embedded + weight("position", [seq, d_model]), [batch * seq, d_model])
        for layer in range(args.layers):
            with tf1.variable_scope(f"layer{layer + 1}"):
                with tf1.variable_scope("attention"):
                    h = layer_norm(h + attention(h), "norm")
                with tf1.variable_scope("moe"):
                    h = layer_norm(h + mixture(h), "norm")
        logits = tf.matmul(h, weight("classifier", [d_model, vocab])) + tf1.get_variable(
            "classifier_bias", [vocab], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(labels, [-1]), logits=logits), name="loss")
        train_op = tf1.train.MomentumOptimizer(args.learning_rate, 0.9).minimize(
            loss, name="train", aggregation_method=tf.AggregationMethod.EXPERIMENTAL_TREE)
        init = tf1.global_variables_initializer()
        count = sum(v.shape.num_elements() for v in tf1.trainable_variables())
    rng = np.random.RandomState(seed)
    data = rng.randint(0, vocab, (batch, seq)).astype(np.int64)
    feed = {tokens: data, labels: (7 * data + 3) % vocab}
    return Model(graph, loss, train_op, init, feed, count, batch)


def add_arguments(group):
    group.add_argument("--layers", type=positive_int,
                       help="encoder layers, each with an MoE feed-forward layer (default 2)")
    group.add_argument("--d-model", type=positive_int, help="(default 64)")
    group.add_argument("--d-ff", type=positive_int,
                       help="hidden units of each expert (default 128)")
    group.add_argument("--heads", type=positive_int, help="attention heads (default 4)")
    group.add_argument("--seq-len", type=positive_int, help="tokens per sentence "
                       "(default 128)")
    group.add_argument("--vocab", type=positive_int, help="(default 256)")
    group.add_argument("--top-k", type=positive_int,
                       help="experts each token is routed to (default 2)")
    group.add_argument("--learning-rate", type=float, help="momentum SGD (default 0.01)")
    group.add_argument("--seed", type=int, help="(default 0)")


def placement_report(args, summaries, stem, out=print):
    """Per size tried: bytes of state the placement pass would move off an accelerator.

    The emulated accelerator is the host itself, so the pass has nothing to
    move in the measured runs; the figure comes from the plan tfmem makes for
    the same graph on a session with a GPU (`make_plan(view, ..., accelerator=...)`).
    """
    del stem, out  # one table, no files
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.plan.analyse import analyse  # pylint: disable=import-outside-toplevel
    from tfmem.plan.build import make_plan  # pylint: disable=import-outside-toplevel
    from tfmem.plan.swap import SwapPolicy  # pylint: disable=import-outside-toplevel
    trials = {(s["system"], t["size"]): t for s in summaries for t in s["all_trials"]}
    rows = []
    for experts in sorted({size for _, size in trials}):
        model = build(tf, experts, args)
        with model.graph.as_default():
            plan = make_plan(analyse([model.loss], [model.train_op], list(model.feed)), 200,
                             SwapPolicy(min_bytes=args.swap_min_bytes or 1 << 20), "GPU:0")
        row = dict(experts=experts, moved_to_host_mib=round(plan.placement.moved_bytes / MIB, 2),
                   moved_ops=len(plan.placement.moved))
        for system in sorted({system for system, _ in trials}):
            trial = trials.get((system, experts)) or {}
            row[f"{system} peak MiB"] = (round(trial["peak_bytes"] / MIB, 1)
                                         if trial.get("peak_bytes") else None)
            row[f"{system} status"] = trial.get("status")
        rows.append(row)
    head = list(dict.fromkeys(key for row in rows for key in row)) or ["experts"]
    lines = ["Placement: state the pass would move off a GPU (from the plan) beside the "
             "measured CPU runs (emulated cap)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("-" if row.get(k) is None else str(row[k]) for k in head) + " |"
              for row in rows]
    return Extra("\n".join(lines) + "\n", data=dict(placement=rows))


MIB = 1 << 20


EXPERIMENT = Experiment(
    name="moe",
    title="Mixture of experts (Transformer encoder, MoE feed-forward layers)",
    size="experts",
    size_help="experts per MoE layer (>= 1)",
    sizes=lambda k: k,
    index_of=experts_of,
    build=build,
    script=__file__,
    add_arguments=add_arguments,
    model_args=("layers", "d_model", "d_ff", "heads", "seq_len", "vocab", "top_k",
                "learning_rate", "seed"),
    # The paper's MoE table: batch 8, partition size 200.  The tensors worth swapping
    # here are 256-512 KiB ([tokens, d_model], [tokens, d_ff]), under tfmem's default
    # swap_min_bytes of 1 MiB, so the threshold is scaled down with the model.
    defaults=dict(layers=2, d_model=64, d_ff=128, heads=4, seq_len=128, vocab=256, top_k=2,
                  learning_rate=0.01, seed=0, batch_size=8, partition_size=200,
                  swap_min_bytes=128 << 10, trial_timeout=600.0),
    # --quick caps the device at plain TensorFlow's peak at 12 experts (the paper's plain
    # maximum), measured on the machine at hand.
    quick=dict(cap_base=12, batch_size=8, max_steps=12, start=4, trial_timeout=60.0,
               tolerance=0.1, search_time=240.0),
    unit="pairs",
    work_unit="expert-pair",
    report=placement_report,
)


if __name__ == "__main__":
    raise SystemExit(main(EXPERIMENT))
