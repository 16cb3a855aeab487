"""`python -m looprl.cli ...` = `looprl ...`."""
import sys

from looprl.cli.main import main

sys.exit(main())
