. /tmp/dev/bin/activate
cd /tmp
for i in 1 2; do for v in new old; do
  rm -rf /work/main/loop && cp -r /tmp/loop-$v /work/main/loop
  redline train /work/main/examples/quickstart.toml --ray-address local --num-rollout 60 --output-dir /tmp/ab-$v-$i --overwrite > /tmp/ab-$v-$i.log 2>&1
  python3 - $v $i <<'PY'
import json, statistics, sys
rs = [json.loads(l) for l in open(f"/tmp/ab-{sys.argv[1]}-{sys.argv[2]}/metrics.jsonl")]
rs = [r for r in rs if r["step"] > 2 and "perf/step_time" in r]
print(sys.argv[1], sys.argv[2], {k.split("/")[1]: round(statistics.median(r[k] for r in rs) * 1e3, 1) for k in ("perf/step_time", "perf/rollout_time", "perf/train_time")}, flush=True)
PY
done; done
rm -rf /work/main/loop && cp -r /tmp/loop-new /work/main/loop
