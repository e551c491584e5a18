"""The ``redline`` console script: ``redline env``, ``redline train``, ``redline bench report``."""

import json
import sys
import types
import typing

import click

from redline.configfile import ConfigError, flag_name, leaf_fields


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@click.version_option(package_name="redline")
def main():
    """redline: RL post-training for LLMs at the speed of the hardware."""


@main.command()
@click.option("--json", "as_json", is_flag=True, help="print machine-readable JSON")
def env(as_json):
    """Versions, GPUs (NVML) and the backends redline will use."""
    from redline.env_report import collect, render

    report = collect()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        from rich.console import Console

        render(report, Console())


def config_options(config_cls):
    """Decorator adding one click option per leaf config field (default None = keep the file's value)."""

    def decorate(command):
        for name, (section, field, kind) in reversed(list(leaf_fields(config_cls).items())):
            help_text = f"[{section}] {field.metadata.get('help', '')}"
            base = kind
            if typing.get_origin(kind) in (typing.Union, types.UnionType):
                base = next(a for a in typing.get_args(kind) if a is not type(None))
            if base is bool:
                decl = f"{flag_name(name)}/--no-{name.replace('_', '-')}"
                command = click.option(decl, name, default=None, help=help_text)(command)
            else:
                command = click.option(flag_name(name), name, default=None, type=str, help=help_text)(command)
        return command

    return decorate


def _train_command():
    from redline.config import RunConfig

    @main.command(context_settings={"show_default": False})
    @click.argument("config_path", type=click.Path(dir_okay=False))
    @config_options(RunConfig)
    def train(config_path, **flags):
        """Run RL post-training from CONFIG_PATH (TOML); flags override the file."""
        from redline.configfile import apply_overrides, load_toml

        try:
            config = load_toml(RunConfig, config_path)
            config = apply_overrides(config, {k: v for k, v in flags.items() if v is not None})
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        from redline.loop import run_training

        exit_on_sigterm()
        sys.exit(run_training(config, config_path=config_path))

    return train


_train_command()


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, Slurm, torchrun tearing down a failed group) exits like Ctrl-C does: through the
    ``finally`` blocks, which stop the SGLang servers and engine processes the run launched in their own process
    groups (a default SIGTERM death would leave them holding GPU memory)."""
    import signal

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


@main.group()
def bench():
    """Benchmark utilities."""


@bench.command("report")
@click.argument("results", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="folder for the markdown table and plots (default: next to the first JSON)")
def bench_report(results, out_dir):
    """Turn benchmark JSON files (or folders of them) into a markdown table and PNG plots."""
    from redline.bench_report import write_report

    for path in write_report(results, out_dir):
        click.echo(path)


if __name__ == "__main__":
    main()
