from gpunode.cli.entry import run

run()
