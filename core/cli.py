"""The ``redline`` console script: ``redline env``, ``redline train``, ``redline bench report``."""

import dataclasses
import faulthandler
import json
import os
import sys
from typing import NoReturn

import click

from redline.configfile import ConfigError, flag_name, flag_type, leaf_fields


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


class SectionOption(click.Option):
    """A config flag that knows its TOML section, so ``--help`` lists it there."""

    def __init__(self, *args, section: str = "Options", **kwargs):
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """``--help`` groups the flags by config section ([model], [rollout], [algo] ...), in declaration order."""

    def format_options(self, ctx, formatter):
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record:
                groups.setdefault(getattr(param, "section", "Options"), []).append(record)
        for section, rows in groups.items():
            with formatter.section(section if section == "Options" else f"[{section}]"):
                formatter.write_dl(rows)


def config_options(config_cls):
    """Decorator adding one typed click option per leaf config field (default None = keep the file's value);
    the help shows the field's type (choices for literals) and its default."""

    def decorate(command):
        for name, (section, field, kind) in reversed(list(leaf_fields(config_cls).items())):
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            help_text = field.metadata.get("help", "") + ("" if default in (None, []) else f" (default: {default})")
            options = dict(cls=SectionOption, section=section, default=None, help=help_text)
            if flag_type(kind) is click.BOOL:
                decl = f"{flag_name(name)}/--no-{name.replace('_', '-')}"
                command = click.option(decl, name, **options)(command)
            else:
                command = click.option(flag_name(name), name, type=flag_type(kind), **options)(command)
        return command

    return decorate


def user_errors() -> tuple[type[Exception], ...]:
    """Exceptions that are the user's to fix (a config value, a data record, a reward function, a missing
    package): ``redline train`` prints them as one ``error:`` line, without a traceback."""
    from redline.extras import MissingExtraError
    from redline.rollout.data import DataError
    from redline.rollout.rewards import RewardError

    return ConfigError, DataError, RewardError, MissingExtraError


def _train_command():
    from redline.config import RunConfig

    @main.command(cls=SectionedCommand, context_settings={"show_default": False})
    @click.argument("config_path", type=click.Path(dir_okay=False))
    @click.option("--debug", is_flag=True, help="show the traceback of an error instead of one line")
    @config_options(RunConfig)
    def train(config_path, debug, **flags):
        """Run RL post-training from CONFIG_PATH (TOML); flags override the file."""
        from redline.configfile import apply_overrides, load_toml

        try:
            config = load_toml(RunConfig, config_path)
            config = apply_overrides(config, {k: v for k, v in flags.items() if v is not None})
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from exc
        from redline.loop import run_training

        exit_on_sigterm()
        # a native crash or abort (a segfault in an extension, a C++ std::terminate in a process group's teardown)
        # prints every thread's Python stack to the process's stderr, naming where the run was: under torchrun,
        # per rank (the process's own stream: sys.stderr may be one without a file descriptor, as click's test
        # runner's is)
        if sys.__stderr__ is not None:
            faulthandler.enable(file=sys.__stderr__, all_threads=True)
        try:
            code = run_training(config, config_path=config_path)
        except user_errors() as exc:
            if debug:
                raise
            click.echo(f"error: {exc}", err=True)
            code = 2
        end_process(code)

    return train


_train_command()


def end_process(code: int) -> NoReturn:
    """Exit with ``code``; a torchrun rank (``TORCHELASTIC_RUN_ID`` set) without interpreter finalization, once its
    output and logs are flushed. At finalization gloo's worker threads can still be dropping the tensors of finished
    collectives, which takes the GIL, and a thread that takes it then aborts the process ("terminate called without
    an active exception", pytorch/pytorch#190489) after the run succeeded: seen in 1 of ~20 two-rank CPU runs. The
    run has closed what it opened (engines, servers, process groups, metrics files, W&B) by the time it returns."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit(code)
    import logging

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


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


@bench.command("e2e", add_help_option=False, context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench_e2e(args):
    """End-to-end GRPO throughput beside other trainers: runs benchmarks/bench_e2e.py of this source checkout with
    ARGS (``redline bench e2e --help`` prints its options)."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e.py"
    if not script.is_file():
        raise click.UsageError(f"{script} not found: `redline bench e2e` runs from a source checkout "
                               "(pip install -e .)")
    sys.exit(subprocess.call([sys.executable, str(script), *args]))


if __name__ == "__main__":
    main()
