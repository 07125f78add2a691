"""``python -m neorec`` (used by torchrun)."""

import sys

from neorec.cli import main

sys.exit(main())
