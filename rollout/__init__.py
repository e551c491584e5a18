"""redline.rollout"""
