"""`python -m lagscope ...`: the `lagscope` command, for an environment whose scripts
directory is not on PATH (`python -m lagscope run --log-dir logs`)."""

from lagscope.cli import entry

if __name__ == "__main__":
    entry()
