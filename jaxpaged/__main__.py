import sys

from jaxpaged.cli import main

sys.exit(main())
