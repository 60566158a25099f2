"""`python -m server --model ... --port ...` (see server/cli.py)."""
import sys

from server.cli import main

sys.exit(main())
