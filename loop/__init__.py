"""The RL loop: ``redline train`` (rollout → rewards → advantages → log-probs → update → sync)."""


def run_training(config, config_path=None) -> int:
    """Run a whole training job; returns the process exit code. ``--ray-address``: its ranks placed by Ray
    (``redline.loop.ray_launch``), each running the same ``redline.loop.train.run``."""
    from redline.loop.fault_tolerance import check_fault_tolerance
    from redline.loop.ray_launch import check_ray_flags, run_on_ray
    from redline.loop.train import run

    check_fault_tolerance(config)
    if config.parallel.ray_address:
        return run_on_ray(config, config_path=config_path)
    check_ray_flags(config)
    return run(config, config_path=config_path)
