"""Builds the rollout side of a run from its config: engine, data, reward, filter, eval sets, manager.

``LoopRollout`` is what the RL step talks to: ``generate(rollout_id)`` → (flat samples, metrics) and
``evaluate(rollout_id)`` → metrics. Each sample's sampling seed is derived from the run seed and the sample's
global index, so a resumed run draws exactly what the uninterrupted run would have; evaluations reuse one set
of seeds, so successive evaluations differ only by the weights.
"""

import asyncio
import contextlib
import functools
import os

from redline.loop.data_parallel import SINGLE_PROCESS, DataParallel
from redline.loop.fault_tolerance import arm_injected_fault, fault_metrics, watched_engine
from redline.rollout.data import DataSource, PromptDataset
from redline.rollout.engine_fan_out import EngineFanOut
from redline.rollout.evaluation import EvalSet, evaluate
from redline.rollout.functions import load_function
from redline.rollout.generate import generate_sample
from redline.rollout.manager import MAX_INFLIGHT, RolloutManager, RolloutOutput
from redline.rollout.rewards import build_reward
from redline.rollout.types import SamplingParams

SEED_STRIDE = 1_000_003


def seeded(generate_fn, base_seed: int):
    """Wrap a generate function so each sample is drawn with its own reproducible seed."""

    async def generate_with_seed(engine, tokenizer, sample, params):
        return await generate_fn(engine, tokenizer, sample, params.replace(seed=base_seed * SEED_STRIDE + sample.index))

    return generate_with_seed


class LoopRollout:
    """``dp``: with several data-parallel ranks, each rank's manager serves its shard of the prompts and
    ``evaluate`` runs its shard of every eval set, then averages over the ranks (collective: call on all).
    ``engine_seat``: this rank's place in a colocated engine of several GPUs (None: the engine is its own).
    ``manager``: a ``RolloutManager`` in this process, or under Ray the handle of this rank's shard of the
    rollout manager actor (``redline.loop.ray_rollout.RemoteManager``, the same interface)."""

    engine_seat = None

    def __init__(self, manager: RolloutManager, engine, tokenizer, eval_sets: list[EvalSet], reward,
                 sft_data: DataSource | None = None, eval_generate_fn=generate_sample,
                 dp: DataParallel = SINGLE_PROCESS):
        self.manager, self.engine, self.tokenizer = manager, engine, tokenizer
        self.eval_sets, self.reward = eval_sets, reward
        self.eval_generate_fn = eval_generate_fn
        self.sft_data = sft_data or manager.data_source
        self.dp = dp

    @property
    def has_eval(self) -> bool:
        return bool(self.eval_sets)

    @property
    def skipped_records(self) -> int:
        """Malformed records that ``--skip-bad-records`` skipped, over every dataset of the run."""
        own = [e.dataset for e in self.eval_sets]
        if self.sft_data is not self.manager.data_source:
            own.append(self.sft_data.dataset)
        return self.manager.skipped_records + sum(d.stats.skipped_bad for d in own)

    async def generate(self, rollout_id: int):
        arm_injected_fault(self.engine, rollout_id)
        return self.handed_over(await self.manager.generate_rollout())

    def handed_over(self, output: RolloutOutput):
        """``(samples, metrics)`` of a rollout's groups for the trainer: the samples in group order, the run's
        counters added (also for the groups of an async rollout's stream)."""
        output.metrics["data/skipped_records"] = float(self.skipped_records)
        output.metrics["rollout/samples"] = float(sum(len(group) for group in output.groups))
        output.metrics.update(fault_metrics(self.engine))
        return [s for group in output.groups for s in group], output.metrics

    async def close(self) -> None:
        """Release what the rewards hold (a grader process, an HTTP session): the manager's and the evaluation's."""
        await self.manager.close()
        await self.reward.close()

    async def evaluate(self, rollout_id: int) -> dict[str, float]:
        metrics = {}
        rank, world = self.dp.rank, self.dp.world
        for eval_set in self.eval_sets:
            shard = await evaluate(self.engine, self.tokenizer, eval_set, self.reward,
                                   generate_fn=self.eval_generate_fn, shard=(rank, world))
            metrics.update(self.dp.weighted_mean(shard, len(range(rank, len(eval_set.dataset), world))))
        if len(self.eval_sets) == 1:  # one set: its numbers under eval/ alone, not also under eval/<name>/
            name = self.eval_sets[0].name
            metrics = {k.replace(f"eval/{name}/", "eval/"): v for k, v in metrics.items()}
        return metrics

    def state_dict(self) -> dict:
        return self.manager.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.manager.load_state_dict(state)


def resolve_engine(config) -> str:
    """``embedded`` or ``sglang``: ``auto`` takes SGLang when it is installed and a CUDA GPU is visible (it runs
    only there), else the embedded engine."""
    import torch

    from redline.extras import available

    choice = config.rollout.rollout_engine
    if choice == "auto":
        return "sglang" if available("sglang") and torch.cuda.is_available() else "embedded"
    return choice


def engine_rows(config) -> int:
    r = config.rollout
    return min(r.rollout_batch_size * r.n_samples_per_prompt, 512)


def build_engine(config, tokenizer, *, device, dtype, log_dir="logs", seat=None, attach=True):
    """The run's rollout engine: colocated with the trainer (same device), or with ``--no-colocate`` on the
    engine devices (``engine_devices``): one SGLang server per ``--rollout-num-gpus-per-engine`` of them, or one
    embedded engine process each (behind an ``EngineGroup`` when several). ``seat``: this rank's place in a
    colocated engine of several GPUs (``redline.loop.engine_placement``); ``attach``: whether this rank, not the
    seat's leader, gets a client of the leader's server (it generates) or None."""
    if not config.parallel.colocate:
        if resolve_engine(config) == "sglang":
            from redline.loop.engine_placement import disaggregated_base_gpus

            if config.rollout.sglang_server_urls:  # attached: their GPUs are theirs already
                return build_sglang_engine(config, log_dir=log_dir)
            first = engine_devices(config)[0].index
            gpus = disaggregated_base_gpus(config.parallel.rollout_num_gpus,
                                           config.parallel.rollout_num_gpus_per_engine, first_gpu=first)
            return build_sglang_engine(config, log_dir=log_dir, gpus=gpus)
        from redline.loop import ray_engines

        if ray_engines.engine_bundles() is not None:  # under Ray: each on its own bundle, wherever Ray put it
            engines = ray_engines.start_engines(functools.partial(_embedded_process_on, config, dtype))
            return engines[0] if len(engines) == 1 else EngineGroup(engines)
        engines = []
        for d in engine_devices(config):
            with only_gpu(d):  # the child sees its GPU as cuda:0, in every one of its threads
                engines.append(build_embedded_process(config, device=d if d.type == "cpu" else "cuda:0", dtype=dtype))
        return engines[0] if len(engines) == 1 else EngineGroup(engines)
    if resolve_engine(config) == "sglang":
        return build_sglang_engine(config, log_dir=log_dir, seat=seat, attach=attach)
    if config.rollout.embedded_engine_process:
        from redline.loop import ray_engines

        if ray_engines.engine_bundles() is not None:  # under Ray: an actor on a share of this rank's bundle
            (engine,) = ray_engines.start_engines(functools.partial(_embedded_process_on, config, dtype,
                                                                    weights_from_elsewhere=True), device=device)
            return engine
        return build_embedded_process(config, device=device, dtype=dtype)
    return build_embedded_engine(config, tokenizer, device=device, dtype=dtype)


def build_embedded_engine(config, tokenizer, *, device, dtype):
    """The embedded engine in this process, on its own copy of the weights."""
    from redline.rollout.embedded.engine import EmbeddedEngine
    from redline.trainer.models import from_pretrained

    model = from_pretrained(config.model.hf_checkpoint, backend="bf16", dtype=dtype, device=device)
    return EmbeddedEngine(model, tokenizer, max_batch_size=engine_rows(config),
                          max_seq_len=engine_seq_len(config, model_context(model.hf_config)),
                          seed=config.train.seed)


def build_embedded_process(config, *, device, dtype, weights_from_elsewhere=False):
    """The embedded engine in its own process (spawned; it loads the checkpoint itself). ``weights_from_elsewhere``:
    its colocated weight sync comes from another process of the node (``EmbeddedEngineProcess``)."""
    from transformers import AutoConfig

    from redline.rollout.embedded.process import EmbeddedEngineProcess

    context = model_context(AutoConfig.from_pretrained(config.model.hf_checkpoint))
    return EmbeddedEngineProcess(config.model.hf_checkpoint, dtype=dtype, device=str(device),
                                 max_batch_size=engine_rows(config), max_seq_len=engine_seq_len(config, context),
                                 seed=config.train.seed, weights_from_elsewhere=weights_from_elsewhere)


def _embedded_process_on(config, dtype, device, weights_from_elsewhere=False):
    return build_embedded_process(config, device=device, dtype=dtype, weights_from_elsewhere=weights_from_elsewhere)


CUDA_GRAPH_FLAGS = {f"--{p}{name}" for p in ("", "sglang-") for name in ("cuda-graph-max-bs", "disable-cuda-graph",
                                                                        "cuda-graph-bs")}


def decode_batch_bound(config, servers: int) -> int:
    """The most requests one of ``servers`` SGLang servers may run at once: a rollout round's requests (under
    ``--async-rollout full`` the ``--max-inflight`` trajectories) spread over them, at most the rollout manager's
    ``MAX_INFLIGHT`` in flight. Launched servers capture CUDA graphs up to it (``--cuda-graph-max-bs``): SGLang's own
    default (256 on an H200) leaves a 512-request rollout decoding without graphs, its GPU idle ~40 % of the rollout."""
    r = config.rollout
    requests = max(r.rollout_batch_size, r.over_sampling_batch_size or 0) * r.n_samples_per_prompt
    if r.async_rollout == "full" and r.max_inflight:
        requests = r.max_inflight
    return min(MAX_INFLIGHT, -(-requests // servers))


PAUSED_TRAINER_FRACTION = 0.7  # beside a trainer paused by --offload-train. H100, Qwen3-4B, 64 x 8 x 1024 tokens:
# 0.7 ran 10 steps (KV cache 302,575 tokens); all but 6 GiB of the free memory (0.915) ran out of memory in the second
# rollout (SGLang's activations and the trainer's growth after the launch need ~11 GiB beyond its CUDA graphs).
# benchmarks/results/loop/sglang-colocated-h100/
RESIDENT_TRAINER_FRACTION = 0.5  # beside a trainer that stays resident


def sglang_mem_fraction(config) -> float | None:
    """``--mem-fraction-static`` for a launched server (SGLang's share, for its weights and KV cache, of the GPU
    memory free when it starts): the user's ``--sglang-mem-fraction-static``; else colocated beside a trainer paused
    by ``--offload-train`` (the colocated SGLang default) ``PAUSED_TRAINER_FRACTION``, beside a resident trainer
    ``RESIDENT_TRAINER_FRACTION``; with ``--no-colocate`` None: SGLang's own default for a GPU of its own."""
    r = config.rollout
    if r.sglang_mem_fraction_static is not None:
        return r.sglang_mem_fraction_static
    if not config.parallel.colocate:
        return None
    from redline.loop.train_offload import offload_train_enabled

    return PAUSED_TRAINER_FRACTION if offload_train_enabled(config) else RESIDENT_TRAINER_FRACTION


def build_sglang_engine(config, *, log_dir, gpus=None, seat=None, attach=True):
    """SGLang launched from ``--hf-checkpoint`` — one server on the trainer's GPU, or with ``--no-colocate`` one
    server from each of ``gpus`` on — or attached to ``--sglang-server-urls``; each server with tensor-parallel
    size ``--rollout-num-gpus-per-engine``. With a ``seat`` (colocated, several GPUs per engine) the seat's
    leader launches the server on its GPU and the next ones, and the other ranks of the seat get a client of it
    (those that generate, ``attach``; None for the others). The memory saver is on with ``--offload-rollout``:
    it is what lets the engine release and resume memory."""
    import torch

    from redline.rollout.sglang.engine import SGLangEngine

    r, tp_size = config.rollout, config.parallel.rollout_num_gpus_per_engine
    if r.sglang_server_urls:
        return SGLangEngine(list(r.sglang_server_urls), tp_size=tp_size)
    args = list(r.sglang_args)
    fraction = sglang_mem_fraction(config)
    if fraction is not None:
        args += ["--mem-fraction-static", str(fraction)]
    if not any(a.split("=", 1)[0] in ("--dtype", "--sglang-dtype") for a in args):
        args += ["--dtype", config.model.dtype]  # the trainer's dtype: its buckets load without a cast
    gpus = gpus if gpus is not None else [torch.cuda.current_device()]
    if not any(a.split("=", 1)[0] in CUDA_GRAPH_FLAGS for a in args):
        args += ["--cuda-graph-max-bs", str(decode_batch_bound(config, len(gpus)))]

    def launch():
        return SGLangEngine.launch(config.model.hf_checkpoint, num_engines=len(gpus), tp_size=tp_size,
                                   sglang_args=args, base_gpu_ids=gpus, log_dir=log_dir,
                                   enable_memory_saver=config.sync.offload_rollout)

    if seat is None:
        return launch()
    from redline.loop.engine_placement import share_engine_url

    def launch_with_url():
        engine = launch()
        return engine, engine.workers[0].url

    engine, url = share_engine_url(seat, launch_with_url)
    if engine is not None or not attach:
        return engine
    return SGLangEngine([url], tp_size=tp_size)


def trainer_device(config):
    """cuda:0 with ``--no-colocate`` (the engines take the next GPUs), else the current CUDA device, or the CPU."""
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", 0) if not config.parallel.colocate else torch.device("cuda")


def trainer_gpus(world_size: int = 1) -> int:
    """How many GPUs of this node, from GPU 0 on, the trainer takes: one per ``torchrun`` process on it
    (``LOCAL_WORLD_SIZE``; its TP × PP × DP ranks on ``cuda:LOCAL_RANK``), else ``world_size`` (one process: 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def engine_devices(config) -> list:
    """``--no-colocate``: one device per engine process — the N GPUs after the trainer's (``trainer_gpus``: cuda:1
    ... cuda:N beside one trainer process), or the CPU N times."""
    import torch

    n = config.parallel.rollout_num_gpus
    if not torch.cuda.is_available():
        return [torch.device("cpu")] * n
    first = trainer_gpus()
    return [torch.device("cuda", first + i) for i in range(n)]


@contextlib.contextmanager
def only_gpu(device):
    """While a child process is spawned: ``CUDA_VISIBLE_DEVICES`` names only ``device`` (of this process's
    numbering), so everything the child runs on its current device — CUDA graph capture streams, Triton launches,
    NCCL — lands on that GPU, from any thread. Nothing on the CPU."""
    if device.type != "cuda":
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [v.strip() for v in before.split(",")] if before else [str(i) for i in range(device.index + 1)]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[device.index]
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


class EngineGroup(EngineFanOut):
    """Several engines as one: each ``generate`` call goes to the next engine in turn (the loop sends one
    request per sample, each with its own seed, so which engine draws it does not change the result); memory,
    pause and shutdown calls go to all. Weights reach them through ``BroadcastWeightSync``, not
    ``update_weights``."""

    def __init__(self, engines):
        self.engines = list(engines)
        self._next = 0

    async def generate(self, requests):
        engine = self.engines[self._next % len(self.engines)]
        self._next += 1
        return await engine.generate(requests)

    async def health(self) -> bool:
        return all(await asyncio.gather(*(e.health() for e in self.engines)))

    def _engines(self) -> list:
        return self.engines


def engine_seq_len(config, context: int) -> int:
    """KV-cache slots per row: the longest prompt allowed plus the response budget, within the context."""
    r = config.rollout
    prompt_len = config.data.rollout_max_prompt_len or context - r.rollout_max_response_len
    return min(context, prompt_len + r.rollout_max_response_len)


def model_context(hf_config) -> int:
    return int(getattr(hf_config, "max_position_embeddings", 4096))


def dataset_options(config) -> dict:
    """``PromptDataset`` options of the run's prompt files (RL, SFT and eval alike)."""
    from transformers import AutoConfig

    from redline.loop.validate import needs_label

    d = config.data
    prompt_room = engine_seq_len(config, model_context(AutoConfig.from_pretrained(config.model.hf_checkpoint))) - 1
    return dict(input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key,
                apply_chat_template=d.apply_chat_template, max_prompt_len=d.rollout_max_prompt_len,
                skip_bad_records=d.skip_bad_records, require_label=needs_label(config), context=prompt_room)


def run_reward(config):
    r = config.rollout
    return build_reward(r.rm_type, custom_rm_path=r.custom_rm_path, group_rm=r.group_rm, rm_url=r.rm_url,
                        timeout=r.rm_timeout, max_retries=r.rm_max_retries, on_error=r.reward_error)


def sampling_params(config) -> SamplingParams:
    r = config.rollout
    return SamplingParams(temperature=r.rollout_temperature, top_p=r.rollout_top_p, top_k=r.rollout_top_k,
                          max_new_tokens=r.rollout_max_response_len, stop=tuple(r.rollout_stop),
                          stop_token_ids=tuple(r.rollout_stop_token_ids), ignore_eos=r.rollout_ignore_eos)


def generate_function(config):
    """``--custom-generate-function-path``'s function, else the default per-sample one (unseeded)."""
    path = config.rollout.custom_generate_function_path
    return load_function(path, what="--custom-generate-function-path", must_be_async=True) if path else generate_sample


def build_manager(config, tokenizer, engine, reward, *, rank: int = 0, world: int = 1) -> RolloutManager:
    """Data-parallel rank ``rank``'s ``RolloutManager`` of ``world``: its shard of the prompt stream
    (``rollout_batch_size / world`` groups per rollout), generating on ``engine`` (None: set ``manager.engine``
    before it generates), scored by ``reward``. Built in the rank's process, or under Ray in the rollout manager
    actor (``redline.loop.ray_rollout``)."""
    d, r = config.data, config.rollout
    data = DataSource(PromptDataset(d.prompt_data, tokenizer, **dataset_options(config)), seed=config.train.seed,
                      shuffle=d.rollout_shuffle, rank=rank, world=world)
    dynamic_filter = (load_function(r.dynamic_sampling_filter_path, what="--dynamic-sampling-filter-path")
                      if r.dynamic_sampling_filter_path else None)
    return RolloutManager(engine, tokenizer, data, reward, params=sampling_params(config),
                          rollout_batch_size=r.rollout_batch_size // world, n_samples_per_prompt=r.n_samples_per_prompt,
                          over_sampling_batch_size=(r.over_sampling_batch_size or r.rollout_batch_size) // world,
                          dynamic_filter=dynamic_filter, partial_rollout=r.partial_rollout,
                          generate_fn=seeded(generate_function(config), config.train.seed))


def build_rollout(config, tokenizer, *, device, dtype, log_dir="logs", dp: DataParallel = SINGLE_PROCESS):
    """``(engine, LoopRollout)`` for the run; with ``dp.world`` ranks, this rank's engine and its share of the
    prompts. Under Ray (``redline train --ray-address``) the ranks that generate get their manager from the
    rollout manager actor; the engine and the evaluation stay in the rank."""
    d, r = config.data, config.rollout
    from redline.loop import ray_rollout
    from redline.loop.dealt_rollout import generates, rollout_shard
    from redline.loop.engine_placement import colocated_engine_seat

    reward = run_reward(config)
    # with --no-colocate under DP > 1 rank 0 alone generates, the whole batch (loop/dealt_rollout.py)
    shard = rollout_shard(config, dp)
    # the data and the reward before the engine: a bad file or reward path fails the start before a launch
    if ray_rollout.on_ray() and generates(config, dp):
        manager = ray_rollout.remote_manager(config, shard)
    else:
        manager = build_manager(config, tokenizer, None, reward, rank=shard.rank, world=shard.world)
    seat = colocated_engine_seat(config)
    # under TP/PP one engine per model-parallel group, on its leader (DataParallel.holds_engine)
    if seat is None:
        engine = watched_engine(config, lambda: build_engine(config, tokenizer, device=device, dtype=dtype,
                                                             log_dir=log_dir)) if generates(config, dp) else None
    else:  # every rank of the seat takes part in its engine's launch (--use-fault-tolerance is refused here)
        engine = build_engine(config, tokenizer, device=device, dtype=dtype, log_dir=log_dir, seat=seat,
                              attach=dp.holds_engine)
    manager.engine = engine
    eval_sets = []
    if d.eval_prompt_data:
        eval_params = sampling_params(config).replace(
            temperature=r.eval_temperature, top_p=r.eval_top_p, ignore_eos=False,
            max_new_tokens=r.eval_max_response_len or r.rollout_max_response_len)
        eval_sets.append(EvalSet(name="eval", dataset=PromptDataset(d.eval_prompt_data, tokenizer,
                                                                    **dataset_options(config)),
                                 params=eval_params, n_samples_per_prompt=r.n_samples_per_eval_prompt))
    sft_data = None
    if d.sft_prompt_data and d.sft_prompt_data != d.prompt_data:
        sft_dataset = PromptDataset(d.sft_prompt_data, tokenizer, **{**dataset_options(config), "require_label": True})
        sft_data = DataSource(sft_dataset, seed=config.train.seed, shuffle=True, rank=dp.rank, world=dp.world)
    # every evaluation draws with the same seeds (its own, not the rollouts'): steps differ only by the weights
    eval_generate_fn = seeded(generate_function(config), config.train.seed + 1)
    rollout = LoopRollout(manager, engine, tokenizer, eval_sets, reward, sft_data, eval_generate_fn, shard)
    rollout.engine_seat = seat
    return engine, rollout
