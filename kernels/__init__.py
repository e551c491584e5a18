"""redline.kernels"""
