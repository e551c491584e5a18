"""Turning one prompt ``Sample`` into a finished one with an engine.

Custom generate functions (``--custom-generate-function-path module:function``, multi-turn / tool use) have
the signature of ``generate_sample``: ``async def fn(engine, tokenizer, sample, params) -> Sample``. They append
policy tokens with ``sample.add_generation(result)`` and outside tokens (tool output, environment turns) with
``sample.append_response(ids, None, trainable=False)``, which masks them out of the loss.
"""

from __future__ import annotations

from redline.rollout.types import GenerateRequest, Sample, SamplingParams, Status


async def generate_sample(engine, tokenizer, sample: Sample, params: SamplingParams) -> Sample:
    """One generate call continuing ``sample`` (from its prompt, or from a partial response after an abort);
    ``params.max_new_tokens`` bounds the whole response, so a continuation gets what is left."""
    budget = params.max_new_tokens - sample.response_length
    if budget > 0:
        [result] = await engine.generate([GenerateRequest(sample.tokens, params.replace(max_new_tokens=budget))])
        sample.add_generation(result)
    else:
        sample.status = Status.TRUNCATED
    sample.response = tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample
