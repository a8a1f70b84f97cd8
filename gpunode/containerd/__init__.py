"""containerd: where its config is, and how the nvidia runtime lives in it."""
