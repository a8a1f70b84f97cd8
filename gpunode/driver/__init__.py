"""The driver step: NVIDIA kernel modules present and loaded for the running kernel."""
