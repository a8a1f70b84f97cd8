from gpunode.entry import run

run()
