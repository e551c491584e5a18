"""The optimizer step at Qwen3-1.7B and Qwen3-8B parameter shapes (random values): redline's mixed-precision step
(bf16 compute weights, fp32 main grads, fp32 master weights and moments: norm + one fused AdamW + the rounded
publish) against the floor, torch's fused AdamW over fp32 parameters of the same shapes with fp32 gradients
(baseline); and the step with ``--optimizer-cpu-offload`` (master and moments in pinned host memory, streamed).

Target (issue 15): the mixed-precision step ≤ 1.2× the floor. An 8B model's fp32 training state does not fit one
80 GB GPU (floor: 16 B/param = 131 GB), so the 8B shapes are measured in two halves (embedding + layers 0–17,
layers 18–35 + norm + LM head), each its own group; the whole-model time is their sum. The offloaded step runs on
the whole model (its GPU share is 6 B/param). ``extra_info["gpu_bytes"]``: GPU memory the state holds after set-up.
"""

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

QWEN3 = {  # hidden, intermediate, layers, heads, kv heads, head dim, vocab, tied
    "1.7B": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "8B": (4096, 12288, 36, 32, 8, 128, 151936, False),
}


def qwen3_shapes(size: str, layers: range | None = None, ends: tuple[bool, bool] = (True, True)):
    """Parameter shapes of a Qwen3 model (``layers``: which decoder layers; ``ends``: with the embedding, with the
    final norm and the untied LM head)."""
    hidden, inter, n_layers, heads, kv, head_dim, vocab, tied = QWEN3[size]
    shapes = [(vocab, hidden)] if ends[0] else []
    for _ in layers if layers is not None else range(n_layers):
        shapes += [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden),
                   (hidden, heads * head_dim), (head_dim,), (head_dim,), (hidden,), (hidden,),
                   (inter, hidden), (inter, hidden), (hidden, inter)]
    if ends[1]:
        shapes += [(hidden,)] + ([] if tied else [(vocab, hidden)])
    return shapes


PARTS = {
    "Qwen3-1.7B": qwen3_shapes("1.7B"),
    "Qwen3-8B, first half": qwen3_shapes("8B", range(18), (True, False)),
    "Qwen3-8B, second half": qwen3_shapes("8B", range(18, 36), (False, True)),
}


def parameters(shapes, dtype) -> torch.nn.ParameterList:
    out = torch.nn.ParameterList()
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="cuda"))
        p.data.normal_(0, 0.02)
        out.append(p)
    return out


def release():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def numel(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


@pytest.mark.parametrize("part", list(PARTS))
def test_torch_fused_adamw_fp32_floor(gpu_bench, part):
    release()
    base = torch.cuda.memory_allocated()
    params = parameters(PARTS[part], torch.float32)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-6, fused=True)
    optimizer.step()  # allocates the moments
    gpu_bench(optimizer.step, group=f"optimizer step {part}", provider="torch fused AdamW, fp32 params (floor)",
              baseline=True, parameters=numel(PARTS[part]), gpu_bytes=torch.cuda.memory_allocated() - base)
    del optimizer, params
    release()


@pytest.mark.parametrize("offload", [False, True], ids=["gpu", "offload"])
@pytest.mark.parametrize("part", list(PARTS) + ["Qwen3-8B"])
def test_redline_mixed_precision_step(gpu_bench, part, offload):
    from redline.trainer.mixed_precision import MasterWeights, MixedPrecisionAdamW

    if part == "Qwen3-8B" and not offload:
        pytest.skip("the whole 8B model's fp32 state does not fit one GPU; measured in halves")
    if part != "Qwen3-8B" and part != "Qwen3-1.7B" and offload:
        pytest.skip("offload is measured on whole models")
    shapes = qwen3_shapes("8B") if part == "Qwen3-8B" else PARTS[part]
    release()
    base = torch.cuda.memory_allocated()
    model = parameters(shapes, torch.bfloat16)
    master = MasterWeights(model, offload=offload)
    optimizer = MixedPrecisionAdamW(master, lr=1e-6)
    for group in master.groups:
        group.main_grad.normal_(0, 1e-3)

    def step():
        master.reduce_and_clip(1.0)
        optimizer.step()

    gpu_bench(step, group=f"optimizer step {part}",
              provider="redline mixed precision" + (", --optimizer-cpu-offload" if offload else ""),
              parameters=numel(shapes), gpu_bytes=torch.cuda.memory_allocated() - base,
              memory_rows=[list(row) for row in master.memory_rows()])
    del optimizer, master, model
    release()
