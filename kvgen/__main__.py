"""`python -m kvgen ...` (what `torchrun -m kvgen ...` runs): the same as the `kvgen` command."""

from kvgen.cli import console

if __name__ == "__main__":
    console()
