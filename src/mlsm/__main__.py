import sys

from mlsm.cli import main

sys.exit(main())
