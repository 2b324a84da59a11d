"""`python -m trajstore` is the `trajstore` command."""

from trajstore.cli import main

main(prog_name="trajstore")
