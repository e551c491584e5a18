"""redline.trainer"""
