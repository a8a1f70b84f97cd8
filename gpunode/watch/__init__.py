"""`gpunode watch`: the node keeps telling the cluster the truth about its GPUs after boot.

xid.py reads the kernel's NVRM Xid lines (pure), state.py remembers what was reported this boot
(/run/gpunode/watch.json), once.py observes the host, decides the GPUReady condition and the
Events, and applies them (or, with --dry-run, prints them).
"""
