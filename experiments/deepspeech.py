"""DeepSpeech: how long a sequence an unrolled bidirectional RNN trains on under a cap.

A DeepSpeech-style acoustic model (Hannun et al. 2014; the network of the
TensorFlowMem paper's RNN experiment) built from TensorFlow ops in graph mode,
no Keras and no tf.while_loop: every time step is its own ops, written out by
Python loops, so the graph, and the activations plain TensorFlow keeps for the
backward pass, grow linearly with the sequence length.

    per frame t:  h1..h3 = dense layers with clipped ReLU on the input frame
                  forward  f_t = clipped ReLU(h3_t Wf + f_{t-1} Uf + bf)
                  backward b_t = clipped ReLU(h3_t Wb + b_{t+1} Ub + bb)
                  h5_t = clipped ReLU((f_t + b_t) W5 + b5)
                  softmax cross-entropy of h5_t W6 + b6 against the frame's label

Weights are shared over time.  The clipped ReLU is relu6 (DeepSpeech clips at
20; relu6 is one op and one gradient op per use).  The loss is the mean
per-frame cross-entropy (no CTC) on seeded synthetic frames and labels;
momentum SGD.  After a --find-max search the script times every system at a
few fixed lengths (--time-seq-lens): the paper's iteration-time table.

    python experiments/deepspeech.py --system tfmem --seq-len 200 --device-memory 40
    python experiments/deepspeech.py --find-max --device-memory 48
    python experiments/deepspeech.py --quick
"""

import copy
import csv
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script: import from the root

from experiments.harness.child import spawn_trial
from experiments.harness.experiment import Experiment, Extra, Model, SYSTEMS
from experiments.harness.main import main
from experiments.harness.options import positive_int
from experiments.harness.reports import pyplot
from experiments.harness.trial import describe_trial

PAPER_PARTITION_SIZE = 5  # the paper's partition size for this experiment


def seq_len_of(k):
    """The search index is the sequence length itself (the search starts at --start)."""
    return k


def index_of(seq_len):
    """Search index of a length; ValueError for lengths that do not exist."""
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    return seq_len


def parameters(features=26, hidden=128, classes=29):
    """Trainable parameters (independent of the sequence length: weights are shared over time)."""
    dense = (features * hidden + hidden) + 2 * (hidden * hidden + hidden)
    recurrent = 2 * (2 * hidden * hidden + hidden)
    return dense + recurrent + (hidden * hidden + hidden) + (hidden * classes + classes)


def build(tf, seq_len, args):
    """The DeepSpeech training step in a new graph (see the module docstring)."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    tf1 = tf.compat.v1
    features, hidden, classes, seed = args.features, args.hidden, args.classes, args.seed
    batch = args.batch_size
    graph = tf.Graph()

    def weight(name, shape, offset, initializer=None):
        init = initializer or tf1.glorot_uniform_initializer
        return tf1.get_variable(name, shape, initializer=init(seed=seed + offset))

    def bias(name, size):
        return tf1.get_variable(name, [size], initializer=tf1.zeros_initializer())

    def layer(x, w, b):
        # relu6 and BiasAdd are one op each with one gradient op each; a broadcasting
        # add or min(relu, 20) would add shape arithmetic to every frame's gradient.
        return tf.nn.relu6(tf.nn.bias_add(tf.matmul(x, w), b))

    with graph.as_default():
        frames = tf1.placeholder(tf.float32, [seq_len, batch, features], name="frames")
        labels = tf1.placeholder(tf.int64, [seq_len, batch], name="labels")
        variables = dict(
            w1=weight("w1", [features, hidden], 1), b1=bias("b1", hidden),
            w2=weight("w2", [hidden, hidden], 2), b2=bias("b2", hidden),
            w3=weight("w3", [hidden, hidden], 3), b3=bias("b3", hidden),
            w_fw=weight("w_fw", [hidden, hidden], 4), b_fw=bias("b_fw", hidden),
            u_fw=weight("u_fw", [hidden, hidden], 5, tf1.orthogonal_initializer),
            w_bw=weight("w_bw", [hidden, hidden], 6), b_bw=bias("b_bw", hidden),
            u_bw=weight("u_bw", [hidden, hidden], 7, tf1.orthogonal_initializer),
            w5=weight("w5", [hidden, hidden], 8), b5=bias("b5", hidden),
            w6=weight("w6", [hidden, classes], 9), b6=bias("b6", classes))
        # Each variable read once: a resource variable used T times would be read T times.
        v = {name: var.read_value() for name, var in variables.items()}
        inputs = tf.unstack(frames, axis=0, name="frame")
        targets = tf.unstack(labels, axis=0, name="label")
        encoded = []
        for t, x in enumerate(inputs):
            with tf1.name_scope(f"dense_t{t}"):
                h = layer(x, v["w1"], v["b1"])
                h = layer(h, v["w2"], v["b2"])
                encoded.append(layer(h, v["w3"], v["b3"]))
        states = {}
        for direction, order in (("fw", range(seq_len)), ("bw", reversed(range(seq_len)))):
            w, u, b = v[f"w_{direction}"], v[f"u_{direction}"], v[f"b_{direction}"]
            state, out = None, [None] * seq_len
            for t in order:
                with tf1.name_scope(f"{direction}_t{t}"):
                    z = tf.matmul(encoded[t], w)
                    if state is not None:
                        z = z + tf.matmul(state, u)
                    state = out[t] = tf.nn.relu6(tf.nn.bias_add(z, b))
            states[direction] = out
        frame_losses = []
        for t in range(seq_len):
            with tf1.name_scope(f"out_t{t}"):
                h5 = layer(states["fw"][t] + states["bw"][t], v["w5"], v["b5"])
                logits = tf.nn.bias_add(tf.matmul(h5, v["w6"]), v["b6"])
                frame_losses.append(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=targets[t], logits=logits))
        loss = tf.reduce_mean(tf.add_n(frame_losses), name="loss") / seq_len
        # GATE_NONE: the default GATE_OP wraps every multi-input gradient in a tuple
        # (an Identity and a NoOp per op), a third of the unrolled graph.
        train_op = tf1.train.MomentumOptimizer(args.learning_rate, 0.9).minimize(
            loss, gate_gradients=tf1.train.Optimizer.GATE_NONE, name="train")
        init = tf1.global_variables_initializer()
        count = sum(var.shape.num_elements() for var in tf1.trainable_variables())
    rng = np.random.RandomState(seed)
    feed = {frames: rng.standard_normal((seq_len, batch, features)).astype(np.float32),
            labels: rng.randint(0, classes, (seq_len, batch)).astype(np.int64)}
    return Model(graph, loss, train_op, init, feed, count, batch)


PAPER_TIMES = {100: (1.15, 1.56), 200: (2.3, 3.03), 400: (4.64, 6.03)}  # s: plain TF, TFMem


def _lengths(text):
    """--time-seq-lens: comma-separated lengths, or none (checked when parsed, not after
    the search)."""
    return [] if text in ("", "none") else [positive_int(n) for n in text.split(",")]


def _iteration_time(trial):
    """The trial's steady-state step (harness/steady.py: the median of the steps after its last
    re-plan), or None when the trial failed or did not reach the steady state."""
    return trial.get("steady_seconds") if trial.get("ok") else None


def _timed_runs(args):
    """(label, system, args) of every column of the iteration-time table.

    The search's settings per system, with --time-steps steps; plus tfmem at
    --time-partition-size (the paper's 5 by default), which always partitions,
    where budget mode runs a step that fits as one partition.
    """
    timed = copy.copy(args)
    timed.steps = args.time_steps
    runs = [(system, system, timed) for system in args.system or SYSTEMS]
    size = args.time_partition_size
    if "tfmem" in [r[0] for r in runs] and size not in (None, "none", str(args.partition_size)):
        fixed = copy.copy(timed)
        fixed.partition_size = size
        runs.append((f"tfmem ps={size}", "tfmem", fixed))
    return runs


def iteration_times(args, summaries, stem, out=print):
    """The paper's second table: iteration time per sequence length, system by system.

    One trial per (length, column), in its own process under the same cap as
    the search, so the times compare like the paper's plain-TF / TFMem pairs.
    """
    del summaries  # the lengths are fixed, not derived from the search
    runs = _timed_runs(args)
    labels = [label for label, _, _ in runs]
    rows = []
    for seq_len in args.time_seq_lens:
        row = dict(seq_len=seq_len)
        for label, system, run_args in runs:
            trial = spawn_trial(EXPERIMENT, run_args, system, seq_len, args.trial_timeout)
            row[label] = _iteration_time(trial)
            row[f"{label} status"] = trial.get("status")
            if system == "tfmem":
                row[f"{label} partitions"] = (trial.get("tfmem") or {}).get("partitions")
            out(f"iteration time ({label}): "
                f"{describe_trial(dict(trial, unit=EXPERIMENT.unit))}")
        rows.append(row)
    markdown = _iteration_markdown(rows, labels, args)
    paths = [f"{stem}-iteration.csv"]
    with open(paths[0], "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(
            key for row in rows for key in row)) or ["seq_len"])
        writer.writeheader()
        writer.writerows(rows)
    note = _iteration_plot(rows, labels, f"{stem}-iteration.png", args)
    if note:
        markdown += f"\n- {note}\n"
    else:
        paths.append(f"{stem}-iteration.png")
    return Extra(markdown=markdown, data=rows, paths=tuple(paths))


def _iteration_markdown(rows, labels, args):
    cap = f"{args.device_memory} MiB" if args.device_memory else "no cap"
    tfmems = [label for label in labels if label.startswith("tfmem")]
    head = (["seq len"] + [f"{label} s" for label in labels]
            + [f"{label} partitions" for label in tfmems]
            + [f"{label} / tf" for label in tfmems if "tf" in labels])
    lines = [f"## Iteration time per sequence length (batch {args.batch_size}, {cap})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["seq_len"])]
        for label in labels:
            value = row.get(label)
            status = row[f"{label} status"]
            cells.append(f"{value:.3f}" if value is not None
                         else "not steady" if status == "ok" else status or "-")
        cells += [str(row.get(f"{label} partitions") or "-") for label in tfmems]
        if "tf" in labels:
            cells += [f"{row[label] / row['tf']:.2f}x" if row.get(label) and row.get("tf")
                      else "-" for label in tfmems]
        lines.append("| " + " | ".join(cells) + " |")
    paper = ", ".join(f"{n}: {tf_s} s vs {tfm_s} s ({tfm_s / tf_s:.2f}x)"
                      for n, (tf_s, tfm_s) in PAPER_TIMES.items())
    lines += ["", f"- iteration time: the steady-state step (the median of the steps after the "
              f"first step and its last re-plan, at least {args.steady_steps} of them; "
              f"{args.time_steps} steps per trial; not steady: fewer), each (length, column) a "
              "fresh process under the cap of the "
              "search; tfmem: the search's settings"
              + (f"; tfmem ps={args.time_partition_size}: partition size "
                 f"{args.time_partition_size}"
                 + (" (the paper's)" if args.time_partition_size == str(PAPER_PARTITION_SIZE)
                    else "") if len(tfmems) > 1 else ""),
              f"- paper (TensorFlowMem, batch 128, partition size 5, 12 GB GPU), plain TF vs "
              f"TFMem per length: {paper}"]
    return "\n".join(lines) + "\n"


def _iteration_plot(rows, labels, path, args):
    """Sequence length against iteration time; None when written, else why not."""
    plt = pyplot()
    if plt is None:
        return "no iteration-time plot: matplotlib is not installed"
    fig, axis = plt.subplots(figsize=(7, 4.5))
    for label in labels:
        points = [(r["seq_len"], r[label]) for r in rows if r.get(label)]
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    axis.set_xlabel("sequence length (frames)")
    axis.set_ylabel("iteration time (s)")
    axis.set_xlim(left=0)
    axis.set_ylim(bottom=0)
    cap = f"{args.device_memory} MiB" if args.device_memory else "no cap"
    axis.set_title(f"DeepSpeech: iteration time, batch {args.batch_size}, {cap}", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def add_arguments(group):
    group.add_argument("--features", type=positive_int,
                       help="input features per frame (default 26, DeepSpeech's MFCCs)")
    group.add_argument("--hidden", type=positive_int,
                       help="units of every hidden layer (default 128; DeepSpeech: 2048)")
    group.add_argument("--classes", type=positive_int,
                       help="output classes per frame (default 29: letters, space, "
                            "apostrophe, blank)")
    group.add_argument("--learning-rate", type=float, help="(default 0.001)")
    group.add_argument("--seed", type=int, help="(default 0)")
    group.add_argument("--time-seq-lens", type=_lengths, metavar="N,N,...",
                       help="--find-max / --quick: after the search, time one trial per system "
                            "at each of these lengths (default 25,50,100; none: skip)")
    group.add_argument("--time-steps", type=positive_int,
                       help="steps of each timed trial (default 10)")
    group.add_argument("--time-partition-size", metavar="N|auto|none",
                       help="also time tfmem at this partition size (default 5, the paper's; "
                            "none: only the search's settings)")


EXPERIMENT = Experiment(
    name="deepspeech",
    title="DeepSpeech (graph mode, bidirectional RNN unrolled over the sequence)",
    size="seq_len",
    size_help="sequence length: frames the RNN is unrolled over",
    sizes=seq_len_of,
    index_of=index_of,
    build=build,
    script=__file__,
    add_arguments=add_arguments,
    model_args=("features", "hidden", "classes", "learning_rate", "seed"),
    # The paper's batch and partition size; per-frame tensors are 64 KiB at batch 128
    # and hidden 128, far below tfmem's 1 MiB swap_min_bytes, so swap from 32 KiB.
    defaults=dict(features=26, hidden=128, classes=29, learning_rate=0.001, seed=0,
                  batch_size=128, partition_size=PAPER_PARTITION_SIZE,
                  swap_min_bytes=32 << 10, start=25, time_seq_lens=[25, 50, 100], time_steps=10,
                  time_partition_size=str(PAPER_PARTITION_SIZE),
                  trial_timeout=600.0),
    # Partition size 5 means one Session call per 5 ops (about 1,400 partitions at
    # length 100) and minutes of first step: --quick uses budget mode instead.
    # The cap: plain TensorFlow's peak at 32 frames, measured on the machine at hand.
    # 100 s of search per system: with 120 the run took 570-604 s, at the 10 minutes
    # quick modes must keep to (plain trials over the cap can take 35-60 s to fail).
    quick=dict(cap_base=32, max_steps=12, partition_size="auto", start=32, tolerance=0.15,
               trial_timeout=60.0, search_time=100.0, time_seq_lens=[16, 32]),
    unit="sequences",
    work_unit="frame-sequence",
    report=iteration_times,
)


if __name__ == "__main__":
    raise SystemExit(main(EXPERIMENT))
