"""The `gpunode` command line: the entry point, the grammar (argparse), dispatch, exit codes and
human output."""
