"""redline.rollout: engines (embedded, SGLang), prompt data, rewards, filters and the rollout manager.

See README.md in this folder for the contracts; ``redline.rollout.engine.Engine`` is the interface the loop
and the sync path use.
"""
