"""``python -m servelab.server [overrides...]``: the same as ``servelab-serve``."""

from servelab.server.cli import main

if __name__ == "__main__":
    main()
