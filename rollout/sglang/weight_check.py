"""Checking what an SGLang server holds against the tensors sent to it (``POST /weights_checker``).

The server hashes each of its parameters with SGLang's ``tensor_hash`` (a hash of the bytes) and answers
``{"ranks": [{"checksums": {name: "%016x"}, ...}], ...}``. The same function over the same bytes here gives
the expected values. SGLang's parameters are HF tensors fused along dim 0 (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``), and its embedding and LM head have their vocabulary rows zero-padded to a multiple of 64,
so the expected tensors are the sent ones fused and padded the same way. Engine TP = 1 only (with
TP each rank holds shards that SGLang's loader cuts). ``/weights_checker`` exists from SGLang 0.5.17 on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

# SGLang's fused parameter -> the HF modules concatenated into it (dim 0, in this order)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# SGLang's vocabulary-parallel embedding and LM head hold their rows padded to a multiple of this
# (DEFAULT_VOCAB_PADDING_SIZE), the padding rows zero-filled by their weight loader
VOCAB_PADDING = 64
VOCAB_PARAMETERS = ("model.embed_tokens.weight", "lm_head.weight")
_PART_OF = {part: (fused, index) for fused, parts in FUSED.items() for index, part in enumerate(parts)}

Hash = Callable[[torch.Tensor], int]


class WeightsMismatch(RuntimeError):
    """The server's parameters are not the tensors that were sent."""


def sglang_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors -> ``(SGLang parameter name, tensor)`` in SGLang's layout, fused parts concatenated in
    SGLang's order whatever order they arrive in. Streamed: a fused parameter is made as soon as its last part
    has arrived and the caller drops it before the next, so checking a whole model holds one fused copy at a
    time rather than most of the model again. A fused parameter missing one of its parts raises ValueError
    naming it."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in named:
        parts = name.rsplit(".", 2)  # prefix, module, "weight" / "bias"
        if not (len(parts) == 3 and parts[1] in _PART_OF):
            yield name, _vocab_padded(tensor) if name in VOCAB_PARAMETERS else tensor
            continue
        fused, index = _PART_OF[parts[1]]
        fused_name = f"{parts[0]}.{fused}.{parts[2]}"
        group = pieces.setdefault(fused_name, {})
        group[index] = tensor
        if len(group) == len(FUSED[fused]):
            del pieces[fused_name]
            yield fused_name, torch.cat([group[i] for i in range(len(group))], dim=0)
    for name, parts in pieces.items():
        fused = name.rsplit(".", 2)[1]
        missing = [FUSED[fused][i] for i in range(len(FUSED[fused])) if i not in parts]
        raise ValueError(f"{name}: the sent tensors lack its part(s) {missing}")


def engine_regions(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, int]]:
    """Where SGLang's loader puts each HF tensor of one bucket (engine TP = 1): ``(SGLang parameter name, byte
    offset in it)``, a fused part after the bytes of the parts before it in SGLang's order, anything else at 0
    (a vocabulary parameter's padding rows come after). Every part before a fused part must be in ``named``
    (the plan keeps a fused set in one bucket); a missing one raises ValueError naming it."""
    sizes: dict[str, dict[int, int]] = {}
    for name, tensor in named:
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1] in _PART_OF:
            fused, index = _PART_OF[parts[1]]
            sizes.setdefault(f"{parts[0]}.{fused}.{parts[2]}", {})[index] = tensor.numel() * tensor.element_size()
    regions = []
    for name, _ in named:
        parts = name.rsplit(".", 2)
        if not (len(parts) == 3 and parts[1] in _PART_OF):
            regions.append((name, 0))
            continue
        fused, index = _PART_OF[parts[1]]
        fused_name = f"{parts[0]}.{fused}.{parts[2]}"
        missing = [FUSED[fused][i] for i in range(index) if i not in sizes[fused_name]]
        if missing:
            raise ValueError(f"{fused_name}: the bucket holding {name} lacks its part(s) {missing}")
        regions.append((fused_name, sum(sizes[fused_name][i] for i in range(index))))
    return regions


def _vocab_padded(tensor: torch.Tensor) -> torch.Tensor:
    """``[vocab, hidden]`` as SGLang holds it: zero rows up to a multiple of ``VOCAB_PADDING``."""
    missing = -tensor.shape[0] % VOCAB_PADDING
    return torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])]) if missing else tensor


def sglang_tensor_hash() -> Hash:
    """SGLang's own hash (needs SGLang importable in this process)."""
    try:
        from sglang.srt.managers.mm_utils import tensor_hash
    except ImportError as error:
        raise ImportError("checking an SGLang server's weights needs SGLang importable in the trainer process "
                          f"(pip install 'redline[sglang]'): {error}") from error
    return tensor_hash


def expected_checksums(named: Iterable[tuple[str, torch.Tensor]], hash_fn: Hash | None = None) -> dict[str, str]:
    """``{SGLang parameter name: "%016x" hash}`` of the sent tensors as the server should hold them."""
    hash_fn = hash_fn or sglang_tensor_hash()
    return {name: f"{hash_fn(t.contiguous()):016x}" for name, t in sglang_parameters(named)}


def compare_checksums(expected: dict[str, str], answer: dict, url: str) -> None:
    """Raise WeightsMismatch unless every rank of ``answer`` (the ``/weights_checker`` body) reports every
    expected parameter with the expected hash; the server's other tensors (buffers) are not ours to check."""
    ranks = answer.get("ranks") if isinstance(answer, dict) else None
    if not ranks:
        raise WeightsMismatch(f"{url}/weights_checker answered no per-rank checksums: {str(answer)[:300]}")
    for rank, info in enumerate(ranks):
        reported = info.get("checksums", {})
        missing = sorted(set(expected) - set(reported))
        wrong = sorted(n for n in expected if n in reported and reported[n] != expected[n])
        if missing or wrong:
            raise WeightsMismatch(f"{url} rank {rank}: {len(wrong)} parameter(s) differ from what was sent "
                                  f"{wrong[:5]}, {len(missing)} not reported {missing[:5]}")
