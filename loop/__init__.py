"""The RL loop: ``redline train`` (rollout → rewards → advantages → log-probs → update → sync)."""


def run_training(config, config_path=None) -> int:
    """Run a whole training job; returns the process exit code."""
    from redline.loop.train import run

    return run(config, config_path=config_path)
