"""`looprl` command line: `main` (parsers + dispatch) and one module per command."""
from looprl.cli.main import main

__all__ = ["main"]
