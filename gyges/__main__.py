"""python -m gyges serve ... | bench serve ... (gyges/serve/cli.py)."""
import sys

from .serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
