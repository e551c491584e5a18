"""Adapters that switch other trainers onto redline's fused kernels (TRL, verl).

Importing this package imports nothing beyond ``redline.kernels``; each adapter module imports its trainer
library only when one of its functions is called. See kernels/README.md, "With TRL" and "With verl".
"""
