"""`python -m gradleak.cli ...`: the same as the `gradleak` command."""

from gradleak.cli import entry

entry()
