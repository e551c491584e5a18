"""When a response ends: stop token ids (EOS included, unless ``ignore_eos``), stop strings, the token budget or
the cache size."""

from __future__ import annotations

from redline.rollout.types import FinishReason, SamplingParams

# Byte-level tokens can decode to fewer characters than they hold (a split UTF-8 character): decoding a few
# more tokens than the longest stop string has characters makes sure a stop string ending now is seen whole.
_EXTRA_TOKENS = 4


class StopChecker:
    """Decides after each new token whether one response is finished, and why."""

    def __init__(self, params: SamplingParams, eos_token_ids: frozenset[int], token_budget: int, tokenizer=None):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need the engine to have a tokenizer (pass tokenizer=...)")
        self.stop_ids = frozenset() if params.ignore_eos else eos_token_ids | frozenset(params.stop_token_ids)
        self.stop_strings = params.stop
        self.token_budget = token_budget  # min(max_new_tokens, room left in the KV cache)
        self.tokenizer = tokenizer
        self._window = max((len(s) for s in params.stop), default=0) + _EXTRA_TOKENS

    def finished(self, output_ids: list[int]) -> FinishReason | None:
        if output_ids and output_ids[-1] in self.stop_ids:
            return FinishReason.STOP
        if self.stop_strings:
            tail = self.tokenizer.decode(output_ids[-self._window:])
            if any(s in tail for s in self.stop_strings):
                return FinishReason.STOP
        if len(output_ids) >= self.token_budget:
            return FinishReason.LENGTH
        return None
