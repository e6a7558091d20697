import sys

from ucl.tools.cli import main

sys.exit(main())
