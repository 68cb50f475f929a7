"""`python -m marinrl.cli ...`, as the `marinrl` console script."""

import sys

from marinrl.cli import main

sys.exit(main())
