"""deepcopy vs a pickle round trip of the quickstart's prompt samples, as DataSource.get_groups copies them."""
import copy, pickle, sys, tempfile, timeit
from pathlib import Path
from transformers import AutoTokenizer
from redline.config import RunConfig
from redline.configfile import apply_overrides, load_toml
from redline.loop.builtin import materialize
from redline.loop.rollout_setup import dataset_options
from redline.rollout.data import PromptDataset

with tempfile.TemporaryDirectory() as scratch:
    config = apply_overrides(load_toml(RunConfig, "examples/quickstart.toml"), {"output_dir": scratch})
    config = apply_overrides(config, materialize(config, Path(scratch) / "builtin"))
    tok = AutoTokenizer.from_pretrained(config.model.hf_checkpoint)
    ds = PromptDataset(config.data.prompt_data, tok, **dataset_options(config))
    samples = ds.samples[:25]
    n = 8
    def deep():
        return [[copy.deepcopy(s) for _ in range(n)] for s in samples]
    def pick():
        out = []
        for s in samples:
            blob = pickle.dumps(s, pickle.HIGHEST_PROTOCOL)
            out.append([pickle.loads(blob) for _ in range(n)])
        return out
    assert pick() == deep()
    for name, fn in (("deepcopy", deep), ("pickle once per prompt, loads per sample", pick)):
        best = min(timeit.repeat(fn, number=20, repeat=7)) / 20
        print(f"{name}: {1e3 * best:.2f} ms per 25 x 8 samples ({1e6 * best / 200:.1f} us per sample)")
    print("sample:", samples[0])
