"""`python -m strata_gui`: the same as the `strata-gui` command."""
import sys

from .app import main

sys.exit(main())
