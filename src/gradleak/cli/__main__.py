"""`python -m gradleak.cli ...`: the same as the `gradleak` command."""

import sys

from gradleak.cli import main

sys.exit(main())
