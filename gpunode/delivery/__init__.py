"""How gpunode reaches a node: the systemd units (package data), the Ignition snippet, and the
values for Giant Swarm's cluster charts."""

# What `gpunode ignition --format` renders: the node snippet three ways, and the values of
# Giant Swarm's cluster charts and the Secret they read (chart.py)
SNIPPET_FORMATS = ("butane", "ignition", "clc")
CHART_FORMATS = ("cluster-azure", "cluster-aws", "cluster-secret")
FORMATS = SNIPPET_FORMATS + CHART_FORMATS
