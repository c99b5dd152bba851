"""`python -m slimopt`: the same command as `slimopt`."""

from slimopt.cli import main

if __name__ == "__main__":  # the guard keeps multiprocessing's re-import of __main__ from running the command
    raise SystemExit(main())
