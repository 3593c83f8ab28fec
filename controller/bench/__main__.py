"""`python -m controller.bench`: the bench command without the main CLI."""

from controller.bench.cli import main

main()
