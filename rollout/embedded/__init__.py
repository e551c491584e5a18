"""The embedded engine: generation with redline's own decoder (see engine.py)."""
