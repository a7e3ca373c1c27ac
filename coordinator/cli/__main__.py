"""`python -m coordinator.cli`: the `shoal` command, as the console script runs it."""

from coordinator.cli.shoal_command import main

main()
