import sys

from gpunode.cli import main

sys.exit(main())
