import sys, threading, json, statistics
from redline.config import RunConfig
from redline.configfile import apply_overrides, load_toml
from redline.loop.train import run
mode, out = sys.argv[1], sys.argv[2]
config = load_toml(RunConfig, "/work/main/examples/quickstart.toml")
config = apply_overrides(config, {"num_rollout": 60, "output_dir": out, "overwrite": True})
if mode == "thread":
    t = threading.Thread(target=run, args=(config, "/work/main/examples/quickstart.toml")); t.start(); t.join()
else:
    run(config, "/work/main/examples/quickstart.toml")
rs = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
rs = [r for r in rs if r["step"] > 2 and "perf/step_time" in r]
print(mode, {k.split("/")[1]: round(statistics.median(r[k] for r in rs) * 1e3, 1) for k in ("perf/step_time", "perf/rollout_time", "perf/train_time")})
