"""`python -m kvgen ...` (what `torchrun -m kvgen ...` runs): the same as the `kvgen` command."""

import sys

from kvgen.cli import main

if __name__ == "__main__":
    sys.exit(main())
