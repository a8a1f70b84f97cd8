import sys

from gpunode.entry import main

sys.exit(main())
