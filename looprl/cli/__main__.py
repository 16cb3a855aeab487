"""`python -m looprl.cli ...` = `looprl ...`."""
from looprl.cli.main import entry

entry()
