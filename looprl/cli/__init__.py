"""`looprl` command line: `main` (parsers + dispatch), `entry` (the executable) and one module
per command."""
from looprl.cli.main import entry, main

__all__ = ["entry", "main"]
