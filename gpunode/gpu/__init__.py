"""The GPUs: NVIDIA PCI functions detected, their product names, and what the loaded driver says
about them."""
