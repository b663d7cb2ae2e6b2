"""`python -m lagscope.cli ...`: the `lagscope` command (the same as `python -m lagscope`)."""

from lagscope.cli import entry

if __name__ == "__main__":
    entry()
