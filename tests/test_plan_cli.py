"""`tfmem plan`: a saved graph in, a plan, its predicted memory and reports out.

Graphs are built here, saved as a MetaGraph (.meta) and as a GraphDef (.pb,
.pbtxt), and the command runs in-process through `tfmem.cli.main`.  What the
command plans must be what `make_plan` plans for the same request; bad input
must end in one message and exit status 2, never a traceback.
"""

import json
import struct
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfmem import cli
from tfmem.cli import serialize
from tfmem.plan.analyse import analyse
from tfmem.plan.build import make_plan
from tfmem.plan.swap import SwapPolicy
from tfmem.run.measuring.trace import TRACKS

tf1 = tf.compat.v1
MIB = 1 << 20


def _mlp_graph():
    """A 4-layer MLP on a [None, 64] placeholder, trained with momentum SGD."""
    graph = tf.Graph()
    rng = np.random.default_rng(0)
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 64], name="x")
        y = tf1.placeholder(tf.float32, [None, 1], name="y")
        h = x
        for i in range(4):
            w = tf1.get_variable(f"w{i}", initializer=rng.normal(0, 0.1, (64, 64)).astype("f4"))
            h = tf.nn.relu(tf.matmul(h, w), name=f"relu{i}")
        w_out = tf1.get_variable("w_out", initializer=rng.normal(0, 0.1, (64, 1)).astype("f4"))
        loss = tf.reduce_mean(tf.square(tf.matmul(h, w_out) - y), name="loss")
        tf1.train.MomentumOptimizer(0.01, 0.9).minimize(loss, name="train")
    return graph


def _loop_graph():
    """A v2 while loop (a `While` op with a function body) and its gradient."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf1.placeholder(tf.float32, [None, 16], name="x")
        kernel = tf.constant(np.eye(16, dtype="f4") * 0.5)
        _, h = tf.while_loop(lambda i, a: i < 5, lambda i, a: (i + 1, tf.tanh(a @ kernel)),
                             [tf.constant(0), x])
        total = tf.reduce_sum(h, name="total")
        tf.identity(tf.gradients(total, x)[0], name="grad")
    assert any(op.type in ("While", "StatelessWhile") for op in graph.get_operations())
    return graph


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{'mlp.meta', 'mlp.pb', 'mlp.pbtxt', 'loop.meta', 'garbage.pb', ...: path}."""
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for stem, graph in (("mlp", _mlp_graph()), ("loop", _loop_graph())):
        with graph.as_default():
            tf1.train.export_meta_graph(filename=str(folder / f"{stem}.meta"), graph=graph)
        tf.io.write_graph(graph.as_graph_def(), str(folder), f"{stem}.pb", as_text=False)
        tf.io.write_graph(graph.as_graph_def(), str(folder), f"{stem}.pbtxt", as_text=True)
        for suffix in ("meta", "pb", "pbtxt"):
            paths[f"{stem}.{suffix}"] = str(folder / f"{stem}.{suffix}")
    (folder / "garbage.pb").write_bytes(np.random.default_rng(1).bytes(512))
    (folder / "garbage.meta").write_text("this is not a graph\n")
    paths["garbage.pb"] = str(folder / "garbage.pb")
    paths["garbage.meta"] = str(folder / "garbage.meta")
    paths["missing.meta"] = str(folder / "missing.meta")
    return paths


def run_cli(capsys, *argv):
    """(exit status, stdout, stderr) of `tfmem plan argv...`, run in-process."""
    try:
        status = cli.main(["plan", *argv])
    except SystemExit as exit_:  # argparse errors
        status = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


MLP_REQUEST = ("--fetch", "train", "--fetch", "loss:0",
               "--feed-shape", "x=256,64", "--feed-shape", "y=256,1")


def _plan_directly(path, fetches, targets, feeds, partition_size, policy=SwapPolicy()):
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(path, clear_devices=True)
    view = analyse([graph.get_tensor_by_name(t) for t in fetches],
                   [graph.get_operation_by_name(o) for o in targets],
                   [graph.get_tensor_by_name(t) for t in feeds])
    return make_plan(view, partition_size, policy)


def test_summary_and_json_match_make_plan(models, capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    status, out, err = run_cli(capsys, models["mlp.meta"], *MLP_REQUEST,
                               "--partition-size", "10", "--json", str(out_json))
    assert status == 0, err
    plan = _plan_directly(models["mlp.meta"], ["loss:0"], ["train"], ["x:0", "y:0"], 10)
    for text in ("part", "ops", "inputs", "outputs", "swapped out MiB", "uploaded MiB",
                 "device peak MiB", "in chunks MiB", "kernel scratch MiB", "host MiB",
                 "in allocator chunks:", f"partitions:            {len(plan.partitions)}",
                 "transfers:", "predicted device peak:", "predicted host peak:", "to host:",
                 "to device:", str(plan.placement)):
        assert text in out
    rows = [line.split() for line in out.splitlines() if line[:6].strip().isdigit()]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(p.index, len(p.ops))
                                                       for p in plan.partitions]

    data = json.loads(out_json.read_text())
    assert [p["ops"] for p in data["partitions"]] == [list(p.ops) for p in plan.partitions]
    assert sorted(op for p in data["partitions"] for op in p["ops"]) == sorted(plan.view.nodes)
    assert [t["tensor"] for t in data["transfers"]] == [t.tensor for t in plan.transfers]
    assert data["partition_size"] == 10 and data["policy"]["mode"] == "auto"
    assert data["request"] == {"fetches": ["loss:0"], "targets": ["train"],
                               "feeds": ["x:0", "y:0"]}
    assert len(data["memory"]["partitions"]) == len(plan.partitions)
    assert data["memory"]["peak_device_bytes"] > 0
    # Both predicted figures, per partition in the table and the JSON, and the band.
    memory = data["memory"]
    assert memory["peak_device_chunks_bytes"] == max(
        p["device_peak_chunks"] for p in memory["partitions"]) >= memory["peak_device_bytes"]
    assert [(float(r[6]), float(r[7]), float(r[8])) for r in rows] == [
        (round(p["device_peak"] / MIB, 2), round(p["device_peak_chunks"] / MIB, 2),
         round(p["scratch"] / MIB, 2)) for p in memory["partitions"]]
    assert (f"predicted band:        {memory['peak_device_bytes'] / MIB:.2f}-"
            f"{memory['peak_device_chunks_bytes'] / MIB:.2f} MiB") in out
    # Plain data, and the same text for the same plan.
    assert json.dumps(data) == json.dumps(json.loads(json.dumps(data)))
    assert json.dumps(serialize.plan_to_dict(plan)) == json.dumps(serialize.plan_to_dict(plan))

    again = tmp_path / "again.json"
    assert run_cli(capsys, models["mlp.meta"], *MLP_REQUEST, "--partition-size", "10",
                   "--json", str(again))[0] == 0
    assert again.read_text() == out_json.read_text()


@pytest.mark.parametrize("form", ["mlp.pb", "mlp.pbtxt"])
def test_graphdef_forms_plan_like_the_metagraph(models, capsys, tmp_path, form):
    paths = {}
    for name in ("mlp.meta", form):
        paths[name] = tmp_path / f"{name}.json"
        status, _, err = run_cli(capsys, models[name], *MLP_REQUEST, "--partition-size", "12",
                                 "--json", str(paths[name]))
        assert status == 0, err
    meta, graph_def = (json.loads(paths[n].read_text()) for n in ("mlp.meta", form))
    assert meta["partitions"] == graph_def["partitions"]
    assert meta["memory"] == graph_def["memory"]


def test_v2_while_loop(models, capsys, tmp_path):
    out_json = tmp_path / "loop.json"
    status, out, err = run_cli(capsys, models["loop.meta"], "--fetch", "grad:0",
                               "--feed-shape", "x=32,16", "--partition-size", "4",
                               "--swap", "all", "--json", str(out_json))
    assert status == 0, err
    plan = _plan_directly(models["loop.meta"], ["grad:0"], [], ["x:0"], 4, SwapPolicy("all"))
    assert f"partitions:            {len(plan.partitions)}" in out
    data = json.loads(out_json.read_text())
    assert [p["ops"] for p in data["partitions"]] == [list(p.ops) for p in plan.partitions]
    assert data["transfers"] and all(t["swapped"] == plan.transfer(t["tensor"]).swapped
                                     for t in data["transfers"])


def test_trace_of_the_planned_step(models, capsys, tmp_path):
    out_trace = tmp_path / "trace.json"
    status, out, err = run_cli(capsys, models["mlp.meta"], *MLP_REQUEST, "--partition-size",
                               "8", "--swap", "all", "--prefetch", "0", "--trace", str(out_trace))
    assert status == 0, err
    assert "nominal" in out
    events = json.loads(out_trace.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    by_track = {track: [e for e in events if e["ph"] == "X" and names[e["tid"]] == track]
                for track in TRACKS}
    assert all(by_track[track] for track in TRACKS), {t: len(e) for t, e in by_track.items()}
    partitions = by_track["partitions"]
    clock = 0.0
    for event in partitions:  # one after another, 1 ms per op
        assert event["ts"] == pytest.approx(clock)
        assert event["dur"] == pytest.approx(1000.0 * event["args"]["ops"])
        clock += event["dur"]
    ends = [e["ts"] + e["dur"] for e in partitions]
    for event in by_track["swap-out"]:
        assert event["ts"] == pytest.approx(ends[event["args"]["producer"]])
    assert sum(e["args"]["bytes"] for e in by_track["swap-out"]) > 0
    for event in by_track["prefetch"]:
        assert event["args"]["bytes"] >= 0 and event["args"]["tensors"]


def test_plot(models, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "memory.png"
    status, out, err = run_cli(capsys, models["mlp.meta"], *MLP_REQUEST, "--partition-size", "8",
                               "--swap", "all", "--plot", str(out_png))
    assert status == 0, err
    data = out_png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200


def test_plot_without_matplotlib(models, capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    status, _, err = run_cli(capsys, models["mlp.meta"], *MLP_REQUEST,
                             "--plot", str(tmp_path / "m.png"))
    assert status == 2
    assert "pip install 'tfmem[plot]'" in err


def test_budget(models, capsys):
    status, out, err = run_cli(capsys, models["mlp.meta"], *MLP_REQUEST, "--budget", "1GiB")
    assert status == 0, err
    assert "fitted to a budget of 1.00 GiB" in out
    status, out, err = run_cli(capsys, models["mlp.meta"], *MLP_REQUEST, "--budget", "1000")
    assert status == 1 and not out
    assert "budget" in err and "largest op" in err


@pytest.mark.parametrize("model, args, expected", [
    ("missing.meta", ["--fetch", "train"], ["missing.meta", "no such file", ".pbtxt"]),
    ("garbage.pb", ["--fetch", "train"], ["garbage.pb", "GraphDef", ".meta"]),
    ("garbage.meta", ["--fetch", "train"], ["garbage.meta", "MetaGraphDef", ".pb"]),
    ("mlp.meta", ["--fetch", "trian"], ["'trian'", "did you mean 'train'"]),
    ("mlp.meta", ["--fetch", "los:0"], ["'los:0'", "did you mean 'loss:0'"]),
    ("mlp.meta", ["--fetch", "loss:0", "--feed-shape", "xx=4,64"],
     ["'xx'", "no placeholder", "did you mean 'x'"]),
    ("mlp.meta", ["--fetch", "loss:0", "--feed-shape", "x=4,64"],
     ["'y'", "not fed", "--feed-shape y=?,1"]),
    ("mlp.meta", ["--fetch", "train"], ["'x'", "'y'", "not fed"]),
    ("mlp.meta", ["--fetch", "loss:0", "--feed-shape", "x=4,63", "--feed-shape", "y=4,1"],
     ["x:0", "[4,63]", "[?,64]"]),
    ("mlp.meta", [*MLP_REQUEST, "--budget", "2 potatoes"], ["--budget", "'2 potatoes'"]),
    ("mlp.meta", [*MLP_REQUEST, "--budget=-1GiB"], ["--budget", "'-1GiB'"]),
    ("mlp.meta", [*MLP_REQUEST, "--partition-size", "0"], ["--partition-size", "'0'"]),
])
def test_errors_exit_2_naming_the_value(models, capsys, model, args, expected):
    status, out, err = run_cli(capsys, models[model], *args)
    assert status == 2
    assert not out
    for text in expected:
        assert text in err, err


def test_fetching_a_fed_tensor_reads_the_feed(models, capsys):
    status, out, err = run_cli(capsys, models["mlp.meta"], "--fetch", "x:0", "--fetch", "loss:0",
                               "--feed-shape", "x=4,64", "--feed-shape", "y:0=4,1")
    assert status == 0, err
    assert "partitions:" in out


def test_kernel_scratch_is_in_every_partitions_predicted_peak(capsys, tmp_path):
    """A convolution net's gradient kernels allocate scratch beyond their outputs: the
    table shows it per partition, and the predicted peaks include it (they exceed the
    simulator's tensor-only prediction by at least that much)."""
    from tfmem.cli import models as zoo  # pylint: disable=import-outside-toplevel
    from tfmem.memory.shapes import resolve_shapes  # pylint: disable=import-outside-toplevel
    from tfmem.memory.simulate import simulate  # pylint: disable=import-outside-toplevel
    model = zoo.convnet()
    path = str(tmp_path / "conv.meta")
    with model.graph.as_default():
        tf1.train.export_meta_graph(filename=path, graph=model.graph)
    shapes = {"images:0": (48, 36, 36, 3), "labels:0": (48,)}
    out_json = tmp_path / "conv.json"
    status, out, err = run_cli(capsys, path, "--fetch", model.train.name, "--fetch",
                               model.loss.name, "--feed-shape", "images=48,36,36,3",
                               "--feed-shape", "labels=48", "--partition-size", "20",
                               "--json", str(out_json))
    assert status == 0, err
    assert "kernel scratch MiB" in out
    predicted = json.loads(out_json.read_text())["memory"]["partitions"]
    plan = _plan_directly(path, [model.loss.name], [model.train.name], list(shapes), 20)
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(path, clear_devices=True)
    tensors_only = simulate(plan, resolve_shapes(graph, plan.view, shapes)).partitions
    assert len(predicted) == len(tensors_only) > 1
    assert any(p["scratch"] > 0 for p in predicted)
    for ours, bare in zip(predicted, tensors_only):
        assert ours["device_peak"] >= bare.device_peak
    assert max(p["device_peak"] for p in predicted) >= \
        max(p.device_peak for p in tensors_only) + max(p["scratch"] for p in predicted) // 2


def test_the_summary_says_whether_the_device_serves_every_request(models):
    """Where the device's limit is known (the emulated accelerator), the summary says
    whether the chunk replay served every request within it."""
    from tfmem.cli.plan import format_summary  # pylint: disable=import-outside-toplevel
    from tfmem.memory.allocator import Regions  # pylint: disable=import-outside-toplevel
    from tfmem.memory.shapes import resolve_shapes  # pylint: disable=import-outside-toplevel
    from tfmem.memory.simulate import simulate  # pylint: disable=import-outside-toplevel
    graph = tf.Graph()
    with graph.as_default():
        tf1.train.import_meta_graph(models["mlp.meta"], clear_devices=True)
    view = analyse([graph.get_tensor_by_name("loss:0")], [graph.get_operation_by_name("train")],
                   [graph.get_tensor_by_name("x:0"), graph.get_tensor_by_name("y:0")])
    plan = make_plan(view, 10)
    shapes = resolve_shapes(graph, view, {"x:0": (4096, 64), "y:0": (4096, 1)})
    unknown = format_summary(plan, simulate(plan, shapes))
    assert "within the device" not in unknown
    roomy = format_summary(plan, simulate(plan, shapes, regions=Regions(limit=1 << 30)))
    assert "the replay serves every request within 1024.00 MiB" in roomy
    tight = simulate(plan, shapes, regions=Regions(limit=2 * MIB))
    assert not tight.served
    assert "NOT SERVED" in format_summary(plan, tight)
