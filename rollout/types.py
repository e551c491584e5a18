"""The records that flow through a rollout: sampling parameters, engine requests/results and ``Sample``.

Conventions shared by every engine:

* Token ids are plain ``list[int]``; the engine never sees text.
* ``logp`` of a generated token is ``log softmax(logits / temperature)[token]`` in fp32: the temperature-scaled
  distribution *before* top-k / top-p truncation. This is what SGLang returns by default and what the trainer
  computes when it divides its logits by ``--rollout-temperature``, so the two are directly comparable.
  With ``temperature == 0`` (greedy) the log-prob is taken under the unscaled logits (temperature 1).
* ``weight_version`` is the version string of the weights that produced the tokens (set by ``update_weights``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token id, a stop string or EOS ended the response
    LENGTH = "length"  # max_new_tokens (or the engine's context limit) was reached
    ABORT = "abort"  # the engine was paused / the request was cancelled before it finished


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    temperature: >= 0; 0 means greedy. top_p: in (0, 1]. top_k: -1 (off) or >= 1.
    max_new_tokens: >= 0 response tokens at most. stop: strings that end the response (kept in the output,
    like SGLang's ``no_stop_trim``). stop_token_ids: ids that end the response (kept, EOS is added by engines).
    ignore_eos: no token id ends the response, neither EOS nor ``stop_token_ids`` (SGLang's ``ignore_eos``); stop
    strings still do. With none, every response runs to ``max_new_tokens`` (fixed-length benchmarks).
    seed: makes the draw reproducible for the same prompt and engine; None draws from the engine's generator.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 0, got {self.max_new_tokens}")
        # Lists from configs are accepted and frozen so the params stay hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def replace(self, **changes) -> SamplingParams:
        values = {f: getattr(self, f) for f in self.__dataclass_fields__}
        values.update(changes)
        return SamplingParams(**values)


@dataclass
class GenerateRequest:
    """One prompt to complete. ``input_ids`` are the full context (prompt, plus earlier turns if any)."""

    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)

    def __post_init__(self):
        if len(self.input_ids) == 0:
            raise ValueError("GenerateRequest.input_ids must hold at least one token")


@dataclass
class GenerateResult:
    """An engine's answer to one request. ``logp`` has one fp32 value per entry of ``output_ids``."""

    output_ids: list[int]
    logp: list[float]
    finish_reason: FinishReason
    weight_version: str

    def __post_init__(self):
        if len(self.output_ids) != len(self.logp):
            raise ValueError(f"GenerateResult: {len(self.output_ids)} output ids but {len(self.logp)} log-probs")


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


STATUS_OF_FINISH = {FinishReason.STOP: Status.COMPLETED, FinishReason.LENGTH: Status.TRUNCATED,
                    FinishReason.ABORT: Status.ABORTED}


@dataclass
class Sample:
    """One prompt and (after generation) one response, with everything the trainer needs.

    tokens: prompt ids followed by response ids. response_length: number of response ids (the tail of
    ``tokens``). loss_mask, rollout_logp: one entry per response token; loss_mask is 1 for tokens the policy
    generated and 0 for tokens inserted from outside (tool output), whose rollout_logp is 0.0.
    weight_versions: the weight version of every generate call that contributed tokens (partial rollouts and
    multi-turn generation can span weight updates). response_versions: one entry per response token, the weight
    version that generated it (None for tokens from outside the policy): a partial rollout continued after a
    weight update holds tokens of two versions.
    """

    prompt: str | list[dict[str, Any]]
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | None = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_logp: list[float] = field(default_factory=list)
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    group_index: int | None = None
    index: int | None = None
    weight_versions: list[str] = field(default_factory=list)
    response_versions: list[str | None] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def response_ids(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.response_length:]

    def append_response(self, ids: list[int], logp: list[float] | None, trainable: bool,
                        version: str | None = None) -> None:
        """Extend the response by ``ids``; policy tokens carry their log-probs, outside tokens get mask 0.

        Keeps ``tokens``, ``loss_mask`` and ``rollout_logp`` aligned: the invariant the trainer relies on.
        """
        if trainable and (logp is None or len(logp) != len(ids)):
            raise ValueError(f"append_response: trainable tokens need one log-prob each, got {len(ids)} ids and "
                             f"{None if logp is None else len(logp)} log-probs")
        self.tokens.extend(ids)
        self.response_length += len(ids)
        self.loss_mask.extend([1 if trainable else 0] * len(ids))
        self.rollout_logp.extend(logp if trainable else [0.0] * len(ids))
        self.response_versions.extend([version] * len(ids))

    def add_generation(self, result: GenerateResult) -> None:
        """Record one engine generation: its tokens (trainable), version and the status its finish reason implies."""
        self.append_response(result.output_ids, result.logp, trainable=True, version=result.weight_version)
        if result.output_ids:
            self.weight_versions.append(result.weight_version)
        self.status = STATUS_OF_FINISH[result.finish_reason]
