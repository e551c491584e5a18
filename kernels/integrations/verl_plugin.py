"""verl's ``external_lib`` hook: importing this module registers redline's policy loss and fused-head backend in
the importing process (``redline.kernels.integrations.verl.register``). Import it only where verl is installed."""

from .verl import register

register()
