import sys

from edgespec.cli import main

sys.exit(main())
