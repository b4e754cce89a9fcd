"""Subcommands of the `tierstore` CLI, one module each (see tierstore.cli.COMMAND_MODULES)."""
