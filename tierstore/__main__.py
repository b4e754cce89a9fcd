import sys

from tierstore.cli import main

sys.exit(main())
