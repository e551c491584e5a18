import asyncio, time, ray, pickle, statistics
from redline.rollout.types import GenerateRequest, SamplingParams
ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")

@ray.remote
class Rank:
    async def each(self, requests, sent):
        yield [(0, time.time() - sent)]
    async def each_bytes(self, blob, sent):
        requests = pickle.loads(blob)
        yield [(0, time.time() - sent)]

@ray.remote
class Manager:
    def __init__(self, rank): self.rank = rank
    async def go(self, n, mode):
        reqs = [GenerateRequest(list(range(12)), SamplingParams(seed=i)) for i in range(n)]
        sent = time.time()
        if mode == "bytes":
            call = self.rank.each_bytes.options(num_returns="streaming").remote(pickle.dumps(reqs, protocol=5), sent)
        else:
            call = self.rank.each.options(num_returns="streaming").remote(reqs, sent)
        async for ref in call:
            (_, lat), = await ref
        return lat, time.time() - sent

r = Rank.remote(); m = Manager.remote(r)
for mode in ("objects", "bytes", "objects", "bytes"):
    ray.get(m.go.remote(200, mode))
    res = [ray.get(m.go.remote(200, mode)) for _ in range(30)]
    print(mode, "reaches the method after", round(statistics.median(x[0] for x in res)*1e3, 2), "ms; round trip", round(statistics.median(x[1] for x in res)*1e3, 2), "ms")
