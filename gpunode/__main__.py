from gpunode.cli.main import run

run()
