"""Turn pytest-benchmark JSON into a markdown table and PNG plots (``redline bench report``).

Benchmarks put their context in ``extra_info``: ``provider`` (who ran), ``baseline`` (True for the provider the
group's ratios are taken against), optional ``flops`` (per call), ``peak_extra_mib``, and free-form shape keys.
"""

import json
from collections import defaultdict
from pathlib import Path

SKIP_KEYS = {"provider", "baseline", "flops", "peak_extra_mib", "nvml_before", "nvml_after", "ratio_vs_baseline"}


def load_runs(paths) -> list[tuple[Path, dict]]:
    files = []
    for path in map(Path, paths):
        files.extend(sorted(path.glob("*.json")) if path.is_dir() else [path])
    runs = []
    for file in files:
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: not valid JSON ({exc})") from exc
        if not isinstance(data, dict) or not data.get("benchmarks"):
            continue  # other JSON in the folder (env samples), or a run whose benchmarks were all deselected
        runs.append((file, data))
    if not runs:
        raise ValueError(f"no pytest-benchmark JSON found in {', '.join(map(str, paths))}")
    return runs


def rows_by_group(data: dict) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for bench in data["benchmarks"]:
        info = bench.get("extra_info", {})
        median_s = bench["stats"]["median"]
        row = {
            "provider": info.get("provider", bench["name"]),
            "median_ms": median_s * 1e3,
            "tflops": info["flops"] / median_s / 1e12 if info.get("flops") else None,
            "peak_extra_mib": info.get("peak_extra_mib"),
            "baseline": bool(info.get("baseline")),
            "error": info.get("error"),
            "shape": ", ".join(f"{k}={v}" for k, v in info.items() if k not in SKIP_KEYS and k != "error"),
        }
        groups[bench.get("group") or bench["name"]].append(row)
    for rows in groups.values():
        base = next((r for r in rows if r["baseline"]), None)
        for row in rows:
            row["ratio"] = row["median_ms"] / base["median_ms"] if base and not row["error"] else None
    return groups


def machine_line(data: dict) -> str:
    info = data.get("machine_info", {})
    env = info.get("redline_env", {})
    software = env.get("software", {})
    gpus = env.get("gpus", {}).get("devices", [])
    gpu = f"{gpus[0]['name']} ×{len(gpus)}, driver {env['gpus'].get('driver')}" if gpus else "no GPU"
    versions = ", ".join(f"{k} {v}" for k, v in software.items() if v != "missing")
    return f"{gpu}; {versions}; run {data.get('datetime', '?')}"


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def markdown(file: Path, data: dict, groups: dict[str, list[dict]]) -> str:
    lines = [f"# {file.stem}", "", machine_line(data), "",
             "| group | provider | median ms | TFLOP/s | peak extra MiB | × baseline | shape |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for group, rows in groups.items():
        for row in sorted(rows, key=lambda r: r["median_ms"]):
            provider = row["provider"] + (" (baseline)" if row["baseline"] else "")
            if row["error"]:
                provider += f" — failed: {row['error']}"
            lines.append(f"| {group} | {provider} | {row['median_ms']:.3f} | {_fmt(row['tflops'], '.1f')} | "
                         f"{_fmt(row['peak_extra_mib'], '.1f')} | {_fmt(row['ratio'], '.2f')} | {row['shape']} |")
    return "\n".join(lines) + "\n"


def plot(path: Path, groups: dict[str, list[dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(groups), 1, figsize=(9, 1.2 + 0.45 * sum(len(r) for r in groups.values())),
                             squeeze=False)
    for ax, (group, rows) in zip(axes[:, 0], groups.items()):
        rows = [r for r in rows if not r["error"]]
        ax.barh([r["provider"] for r in rows], [r["median_ms"] for r in rows],
                color=["tab:gray" if r["baseline"] else "tab:red" for r in rows])
        ax.set_title(group, fontsize=9)
        ax.set_xlabel("median ms (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(paths, out_dir=None) -> list[Path]:
    """Write ``<stem>.md`` and ``<stem>.png`` for every benchmark JSON; returns the written paths."""
    written = []
    for file, data in load_runs(paths):
        target = Path(out_dir) if out_dir else file.parent
        target.mkdir(parents=True, exist_ok=True)
        groups = rows_by_group(data)
        md_path, png_path = target / f"{file.stem}.md", target / f"{file.stem}.png"
        md_path.write_text(markdown(file, data, groups))
        plot(png_path, groups)
        written += [md_path, png_path]
    return written
