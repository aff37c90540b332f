"""``python -m flashpoint.cli``."""

import sys

from flashpoint.cli.app import main

sys.exit(main())
