"""How a decoder's layers split over pipeline stages: counts per stage, the LM head's share of the last one."""

from collections.abc import Sequence


def head_cost_layers(spec) -> float:
    """The LM head's forward + backward cost in decoder layers of ``spec`` (a ``ModelSpec``), for balancing pipeline
    stages: its GEMM FLOPs over a layer's (q, k, v, o and the three MLP projections). Profiled on two H200s (Qwen3-8B's
    shape, 8 layers split 5 + 3, PP=2) the head cost ~3.7 layers where this says 3.2: a layer's attention and
    elementwise work and the head's loss epilogue roughly cancel."""
    h = spec.hidden_size
    layer = h * (2 * spec.q_dim + 2 * spec.kv_dim) + 3 * h * spec.intermediate_size
    return spec.vocab_size * h / layer


def stage_sizes(num_layers: int, pp: int, *, first: int | None = None, last: int | None = None,
                head_layers: float = 0.0) -> list[int]:
    """Decoder layers per pipeline stage, first to last (Megatron's ``--decoder-first/last-pipeline-num-layers``):
    ``first`` / ``last`` layers on the first / last stage where given, the rest split evenly over the other stages
    (the earlier ones one longer). With neither given, the last stage (which also runs the LM head, costing
    ``head_layers`` layers) gets the number of layers that makes the slowest stage fastest; ties go to fewer
    layers on the earlier stages. ValueError when a stage would get no layer or the counts do not add up."""
    if num_layers < pp:
        raise ValueError(f"num_hidden_layers={num_layers} is less than pp={pp}")
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        candidates = [stage_sizes(num_layers, pp, last=n) for n in range(num_layers - pp + 1, 0, -1)]
        return min(candidates, key=lambda sizes: max(max(sizes[:-1]), sizes[-1] + head_layers))
    fixed = {0: first, pp - 1: last}
    fixed = {stage: n for stage, n in fixed.items() if n is not None}
    free = [s for s in range(pp) if s not in fixed]
    rest = num_layers - sum(fixed.values())
    named = " + ".join(f"{'first' if s == 0 else 'last'} {n}" for s, n in fixed.items())
    if any(n < 1 for n in fixed.values()) or (free and rest < len(free)) or (not free and rest != 0):
        raise ValueError(f"{named} layers leave {rest} of {num_layers} for the other {len(free)} of {pp} stages: "
                         "every stage needs at least one layer and the stages must hold every layer")
    base, extra = divmod(rest, len(free)) if free else (0, 0)
    even = {s: base + (i < extra) for i, s in enumerate(free)}
    return [fixed.get(s, even.get(s)) for s in range(pp)]


def stage_layers(sizes: Sequence[int], stage: int) -> range:
    """Layer indices of ``stage`` for per-stage layer counts ``sizes`` (``stage_sizes``): contiguous, in order."""
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])
