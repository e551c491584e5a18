"""``ignore_eos`` (``--rollout-ignore-eos``): no token id ends a response, so responses run to their length."""

from redline.rollout.embedded.engine import EmbeddedEngine
from redline.rollout.embedded.stops import StopChecker
from redline.rollout.sglang.client import sampling_payload
from redline.rollout.types import FinishReason, GenerateRequest, SamplingParams
from .engine_runner import run

EOS = 0


def test_stop_checker_ignores_eos_and_stop_token_ids_but_not_stop_strings(tokenizer):
    params = SamplingParams(max_new_tokens=4, stop_token_ids=(7,), stop=("fox",), ignore_eos=True)
    stop = StopChecker(params, frozenset({EOS}), token_budget=4, tokenizer=tokenizer)
    assert stop.finished([5, EOS]) is None and stop.finished([5, 7]) is None
    assert stop.finished(tokenizer.encode("the fox")) == FinishReason.STOP
    assert stop.finished([5, EOS, 7, EOS]) == FinishReason.LENGTH


def test_stop_checker_stops_at_eos_by_default():
    stop = StopChecker(SamplingParams(max_new_tokens=4), frozenset({EOS}), token_budget=4)
    assert stop.finished([5, EOS]) == FinishReason.STOP


def test_embedded_engine_runs_every_response_to_its_length(model_dir):
    # every id is an end-of-sequence token: without ignore_eos each response ends after its first token
    engine = EmbeddedEngine.from_pretrained(model_dir, max_batch_size=4, max_seq_len=64,
                                            eos_token_ids=tuple(range(512)))
    prompt = engine.tokenizer.encode("The quick brown fox")
    stopping, fixed = run(engine, lambda e: e.generate([
        GenerateRequest(prompt, SamplingParams(max_new_tokens=12, seed=0)),
        GenerateRequest(prompt, SamplingParams(max_new_tokens=12, seed=0, ignore_eos=True))]))
    assert len(stopping.output_ids) == 1 and stopping.finish_reason == FinishReason.STOP
    assert len(fixed.output_ids) == 12 and fixed.finish_reason == FinishReason.LENGTH


def test_sglang_request_carries_ignore_eos():
    assert sampling_payload(GenerateRequest([1], SamplingParams(ignore_eos=True)))["ignore_eos"] is True
    assert sampling_payload(GenerateRequest([1], SamplingParams()))["ignore_eos"] is False
