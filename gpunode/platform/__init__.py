"""The host gpunode runs on: the one boundary under --root (safe reads, atomic writes), locks,
external commands, systemd, kernel and Flatcar facts."""
