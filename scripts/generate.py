"""Same as ``jaxpaged-generate`` / ``python -m jaxpaged``."""

import sys

from jaxpaged.cli import main

if __name__ == "__main__":
    sys.exit(main())
