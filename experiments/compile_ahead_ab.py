"""Paired A/B in one process: first step of ResNet-56 (batch 32) with and without compile ahead,
each on a fresh graph and session, back to back, order alternating; plain's first step likewise
(TensorFlow's default config; tfmem on tfmem.session_config()).

    TF_ENABLE_ONEDNN_OPTS=0 python experiments/compile_ahead_ab.py 50 6 [out.json]
"""
import os, sys, time, json, statistics
os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
import tensorflow as tf, tfmem
from tfmem.cli import models, provenance
size = int(sys.argv[1]); pairs = int(sys.argv[2])
out_path = sys.argv[3] if len(sys.argv) > 3 else None

def first(mode):
    m = models.resnet(blocks=(9, 9, 9))
    feed = m.feed(32)
    cfg = tfmem.session_config() if mode != "plain" else tf.compat.v1.ConfigProto()
    sess = tf.compat.v1.Session(graph=m.graph, config=cfg)
    sess.run(m.init)
    t = time.perf_counter()
    if mode == "plain":
        sess.run([m.train, m.loss], feed); out = dict(first=time.perf_counter() - t)
    else:
        tfs = tfmem.TFMemSession(sess, partition_size=size, compile_ahead=(mode == "ahead"))
        tfs.run([m.train, m.loss], feed)
        c = tfs.last_compile
        out = dict(first=time.perf_counter() - t, run=tfs.last_step.wall_time, callables=c.callables_time,
                   waited=c.callables_waited, pre=c.plan_time + c.rewrite_time + c.extend_time)
    sess.close()
    return out

rows = []
for p in range(pairs):
    order = ("plain", "serial", "ahead") if p % 2 == 0 else ("ahead", "serial", "plain")
    r = {"load": os.getloadavg()[0]}
    for mode in order:
        r[mode] = first(mode)
    r["ahead/serial"] = r["ahead"]["first"] / r["serial"]["first"]
    rows.append(r)
    print(json.dumps(r, default=lambda v: round(v, 3)), flush=True)
if out_path:
    with open(out_path, "w", encoding="utf-8") as out:
        json.dump(dict(provenance=provenance.provenance("Eigen (oneDNN off)"), partition_size=size,
                       rows=rows), out, indent=1)
print("median ahead/serial", round(statistics.median(r["ahead/serial"] for r in rows), 3),
      "median ratio to plain: serial", round(statistics.median(r["serial"]["first"] / r["plain"]["first"] for r in rows), 2),
      "ahead", round(statistics.median(r["ahead"]["first"] / r["plain"]["first"] for r in rows), 2))
