"""``python -m twiceshy``: the command line."""

from twiceshy.cli import main

if __name__ == "__main__":
    main()
