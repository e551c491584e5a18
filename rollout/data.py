"""Prompt datasets: JSONL / Parquet records → tokenized prompt ``Sample``s, and the data source that serves
them in groups (seeded per-epoch shuffling, a buffer of returned groups, resumable state).

Record layout (keys configurable, slime's ``--input-key`` / ``--label-key`` / ``--metadata-key``):
``{"prompt": str | [{"role": ..., "content": ...}, ...], "label": any, "metadata": {...}}``.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redline.extras import require
from redline.rollout.types import Sample, Status


class DataError(ValueError):
    """A record of a prompt file is malformed; the message names the file and line (or row)."""


@dataclass
class LoadStats:
    """What loading dropped: malformed records skipped on request, and prompts over the length limit."""

    records: int = 0
    skipped_bad: int = 0
    filtered_too_long: int = 0


def _jsonl_records(path: Path):
    """Yield (location, record-or-error) for every non-blank line of a JSONL file (UTF-8)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            location = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield location, DataError(f"{location}: not UTF-8 (byte {raw[exc.start]:#04x} at column "
                                          f"{exc.start + 1})")
                continue
            if not line.strip():
                continue
            try:
                yield location, json.loads(line)
            except json.JSONDecodeError as exc:
                yield location, DataError(f"{location}: not valid JSON ({exc.msg})")


def _parquet_records(path: Path):
    require("pyarrow", "reading Parquet prompt data")
    import pyarrow.parquet as pq

    for row, record in enumerate(pq.read_table(path).to_pylist()):
        yield f"{path} row {row}", record


def read_records(path: str | Path):
    """Yield ``(location, record)`` pairs from a ``.jsonl`` or ``.parquet`` file; a bad JSON line yields a
    DataError instead of a record so the caller decides whether to raise or skip."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt data file not found: {path}")
    if path.suffix == ".jsonl":
        return _jsonl_records(path)
    if path.suffix == ".parquet":
        return _parquet_records(path)
    raise ValueError(f"prompt data {path}: unsupported format '{path.suffix}' (use .jsonl or .parquet)")


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_record(location: str, record, *, input_key: str = "prompt", label_key: str | None = "label",
                 metadata_key: str | None = None, require_label: bool = False) -> dict:
    """The record (a dict) if it has what a run reads from it; else raise DataError naming ``location``."""
    if isinstance(record, DataError):
        raise record
    if not isinstance(record, dict):
        raise DataError(f"{location}: expected a JSON object, got {type(record).__name__}")
    if input_key not in record:
        raise DataError(f"{location}: no key '{input_key}' (--input-key); keys there: {sorted(record)}")
    prompt = record[input_key]
    if not (isinstance(prompt, str) or _is_messages(prompt)):
        raise DataError(f"{location}: '{input_key}' must be a string or a list of chat messages")
    if require_label and (label_key is None or record.get(label_key) is None):
        raise DataError(f"{location}: no label under '{label_key}' (--label-key), which the reward / SFT needs; "
                        f"keys there: {sorted(record)}")
    metadata = record.get(metadata_key) if metadata_key else None
    if metadata is not None and not isinstance(metadata, dict):
        raise DataError(f"{location}: '{metadata_key}' must be an object, got {type(metadata).__name__}")
    return record


class PromptDataset:
    """Tokenized prompts of one file, in file order.

    ``samples[i].tokens`` holds the prompt ids; ``prompt`` the text the ids were made from (after the chat
    template). Prompts longer than ``max_prompt_len`` tokens are dropped and counted in ``stats``; one longer
    than ``context`` (the most prompt tokens the engine takes) is an error, found here rather than when drawn.
    ``require_label``: a record without a label is malformed. ``skip_bad_records``: malformed records are
    skipped and counted (``stats.skipped_bad``) instead of raising.
    """

    def __init__(self, path: str | Path, tokenizer, *, input_key: str = "prompt", label_key: str | None = "label",
                 metadata_key: str | None = None, apply_chat_template: bool = False,
                 max_prompt_len: int | None = None, skip_bad_records: bool = False, require_label: bool = False,
                 context: int | None = None):
        if max_prompt_len is not None and max_prompt_len < 1:
            raise ValueError(f"max_prompt_len must be >= 1, got {max_prompt_len}")
        self.path = Path(path)
        self.stats = LoadStats()
        self.samples: list[Sample] = []
        self._tokenizer = tokenizer
        self._apply_chat_template = apply_chat_template
        for location, record in read_records(path):
            try:
                record = check_record(location, record, input_key=input_key, label_key=label_key,
                                      metadata_key=metadata_key, require_label=require_label)
                sample = self._to_sample(location, record, input_key, label_key, metadata_key)
            except DataError:
                if not skip_bad_records:
                    raise
                self.stats.skipped_bad += 1
                continue
            self.stats.records += 1
            if max_prompt_len is not None and len(sample.tokens) > max_prompt_len:
                self.stats.filtered_too_long += 1
                continue
            if context is not None and len(sample.tokens) > context:
                raise DataError(f"{location}: the prompt is {len(sample.tokens)} tokens, longer than the engine's "
                                f"context takes ({context} tokens with room for a response); set "
                                f"--rollout-max-prompt-len {context} (or less) to drop (and count) longer prompts")
            self.samples.append(sample)

    def __len__(self) -> int:
        return len(self.samples)

    def _to_sample(self, location, record, input_key, label_key, metadata_key) -> Sample:
        text = self._render(location, record[input_key])
        tokens = list(self._tokenizer.encode(text, add_special_tokens=not self._apply_chat_template))
        metadata = record.get(metadata_key) if metadata_key else None
        return Sample(prompt=text, tokens=tokens, label=record.get(label_key) if label_key else None,
                      metadata=dict(metadata or {}))

    def _render(self, location, prompt) -> str:
        if self._apply_chat_template:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(prompt, str):
            raise DataError(f"{location}: chat messages need apply_chat_template=True (--apply-chat-template)")
        return prompt


class DataSource:
    """Serves prompt groups: returned (unfinished) groups first, then the dataset in a per-epoch order drawn
    from ``seed + epoch``. The position survives ``state_dict()`` / ``load_state_dict()``.

    Sharded across ``world`` data-parallel ranks: the epochs form one global stream and rank ``r`` takes its
    positions ``r, r + world, r + 2·world, ...``; group ``j`` of rank ``r`` gets the global group index
    ``j·world + r``. The ranks' groups together are then the groups one unsharded source would serve (same
    prompts, same indices, hence the same per-sample seeds), and no two ranks share a prompt."""

    def __init__(self, dataset: PromptDataset, *, seed: int = 1234, shuffle: bool = True, rank: int = 0,
                 world: int = 1):
        if len(dataset) == 0:
            raise ValueError(f"prompt dataset {dataset.path} has no usable prompts (stats: {dataset.stats})")
        if not 0 <= rank < world:
            raise ValueError(f"DataSource: need 0 <= rank < world, got rank={rank} world={world}")
        self.dataset = dataset
        self.seed = seed
        self.shuffle = shuffle
        self.rank, self.world = rank, world
        self.position = 0  # prompts of the global stream consumed by all ranks together (this rank's next: + rank)
        self.next_group_index = rank
        self.buffer: list[list[Sample]] = []
        self._orders: dict[int, list[int]] = {}

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            self._orders = {epoch: order}  # epochs are visited in order: one cached order is enough
        return self._orders[epoch]

    def _next_prompt(self) -> Sample:
        epoch, offset = divmod(self.position + self.rank, len(self.dataset))
        self.position += self.world
        return self.dataset.samples[self._epoch_order(epoch)[offset]]

    def get_groups(self, num_groups: int, n_samples_per_prompt: int) -> list[list[Sample]]:
        """``num_groups`` groups of ``n_samples_per_prompt`` fresh copies of one prompt each. A copy is a pickle
        round trip of the dataset's sample (plain JSON data): what ``copy.deepcopy`` makes of it, in 5.8-5.9 against
        13.8-14.1 µs a sample on the CPU machine (``benchmarks/results/loop/get-groups-copy-cpu/``)."""
        if num_groups < 0 or n_samples_per_prompt < 1:
            raise ValueError(f"get_groups: need num_groups >= 0 and n_samples_per_prompt >= 1, "
                             f"got {num_groups}, {n_samples_per_prompt}")
        groups = self.buffer[:num_groups]
        del self.buffer[:num_groups]
        while len(groups) < num_groups:
            prompt = pickle.dumps(self._next_prompt(), pickle.HIGHEST_PROTOCOL)
            group = []
            for i in range(n_samples_per_prompt):
                sample = pickle.loads(prompt)
                sample.group_index = self.next_group_index
                sample.index = self.next_group_index * n_samples_per_prompt + i
                group.append(sample)
            self.next_group_index += self.world
            groups.append(group)
        return groups

    def add_groups(self, groups: list[list[Sample]]) -> None:
        """Return groups to be served again (partial rollout); their generated tokens are kept."""
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "next_group_index": self.next_group_index, "seed": self.seed,
                "shuffle": self.shuffle, "rank": self.rank, "world": self.world,
                "buffer": [[dataclasses.asdict(s) for s in g] for g in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = tuple(state[k] for k in ("seed", "shuffle", "rank", "world"))
        if saved != (self.seed, self.shuffle, self.rank, self.world):
            raise ValueError(f"data state was saved with seed, shuffle, rank, world = {saved}; this source has "
                             f"{(self.seed, self.shuffle, self.rank, self.world)}")
        self.position, self.next_group_index = state["position"], state["next_group_index"]
        self.buffer = [[Sample(**{**s, "status": Status(s["status"])}) for s in g] for g in state["buffer"]]
