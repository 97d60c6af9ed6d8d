"""Subcommands of the ``ocache`` command line (each module has ``register(subparsers)``; ``ocache.cli``
collects them). The runtime core never imports this package."""
