import gzip
import statistics
for mode in ("noray", "ray"):
    rows = [l.split() for l in gzip.open(f"marks-{mode}.txt.gz", "rt")]
    rows = sorted(((float(t), n) for n, t in rows))
    rollouts, cur = [], None
    for t, n in rows:
        if n == "manager_starts":
            cur = {"t0": t}; rollouts.append(cur)
        elif cur is not None:
            cur.setdefault(n, []).append(t)
    rollouts = [r for r in rollouts if "manager_done" in r][3:]
    def rel(r, n, pick):
        return (pick(r[n]) - r["t0"]) * 1e3 if n in r else None
    cols = [("last sample sent", "sample_sent", max), ("batch sent to rank", "send", min), ("rank's relay starts", "relay", min),
            ("fan-out starts", "fanout", min), ("engine has requests", "engine_queued", min), ("engine's first step", "engine_step", min),
            ("first answer back", "sample_back", min), ("median answer back", "sample_back", statistics.median),
            ("last answer back", "sample_back", max), ("manager done", "manager_done", min), ("rank has batch", "rank_has_batch", min)]
    print(f"## {mode}: {len(rollouts)} rollouts (medians, ms after the manager starts)")
    for label, n, pick in cols:
        vals = [rel(r, n, pick) for r in rollouts if n in r]
        if vals:
            print(f"| {label} | {statistics.median(vals):.1f} |")
