"""`python -m store` is the `trajstore` command."""

from store.cli import main

main(prog_name="trajstore")
