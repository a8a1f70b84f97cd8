"""How gpunode reaches a node: the systemd units (package data), the Ignition snippet, and the
values for Giant Swarm's cluster charts."""
