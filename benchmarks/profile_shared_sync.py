"""Where the time of a shared-weights push goes on the host (in-process engine): one model as the trainer's flat
compute buffer, one embedded engine, ``EngineTargets.share`` repeated; cProfile of the steady state.
    python benchmarks/profile_shared_sync.py MODEL_DIR"""
import cProfile
import pstats
import sys
import time

import torch
from redline.rollout.embedded.colocated import EngineTargets
from redline.rollout.embedded.engine import EmbeddedEngine
from redline.rollout.embedded.weights import flatten_parameters
from redline.sync.zero_copy import plan_in_place
from redline.trainer.models import from_pretrained

device = "cuda" if torch.cuda.is_available() else "cpu"
trainer = from_pretrained(sys.argv[1], backend="bf16", dtype=torch.bfloat16, device=device)
flatten_parameters(trainer)
plan, flats = plan_in_place(trainer.export_hf(), 512 * 2**20)
engine = EmbeddedEngine.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device=device, max_batch_size=2,
                                        max_seq_len=64)
targets = EngineTargets(engine)
for _ in range(3):
    start = time.perf_counter()
    targets.share(flats, plan)
    print(f"share: {(time.perf_counter() - start) * 1e3:.2f} ms")
profile = cProfile.Profile()
profile.enable()
for _ in range(20):
    targets.share(flats, plan)
profile.disable()
pstats.Stats(profile).sort_stats("cumulative").print_stats(15)
