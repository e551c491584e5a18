"""Bytes of the trainer's training state: compute weights, gradients, master weights, moments — per model, on the
GPU and on the host. Printed at start-up and written into ``report.md``."""

from redline.trainer.mixed_precision import MasterWeights


def memory_rows(model, master: MasterWeights | None) -> list[tuple[str, float, int, str]]:
    """``(what, bytes per parameter, bytes on this rank, where)`` of one model's training state."""
    if master is not None:
        return master.memory_rows()
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    where = trainable[0].device.type
    return [("weights (fp32, stepped in place)", 4.0, 4 * numel, where), ("gradients (fp32)", 4.0, 4 * numel, where),
            ("Adam moments (fp32 × 2)", 8.0, 8 * numel, where)]


def memory_table(models: dict[str, tuple]) -> list[str]:
    """Markdown table of ``{name: (model, master or None)}``: one row per part, then the totals per place."""
    lines = ["| model | state | bytes / parameter | size | where |", "| --- | --- | ---: | ---: | --- |"]
    totals: dict[str, int] = {}
    for name, (model, master) in models.items():
        for what, per_param, total, where in memory_rows(model, master):
            lines.append(f"| {name} | {what} | {per_param:g} | {size(total)} | {where} |")
            totals[where] = totals.get(where, 0) + total
    for where, total in totals.items():
        lines.append(f"| all | total | | {size(total)} | {where} |")
    return lines


def size(nbytes: int) -> str:
    """``nbytes`` in GiB from 1 GiB on, else in MiB."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
