"""gpunode image bake: the bake config, fetching and verifying artifacts, placing them, and
the bake manifest read back (docs/cli.md, "gpunode image bake")."""
