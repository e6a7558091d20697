import sys

from ucl.cli import main

sys.exit(main())
