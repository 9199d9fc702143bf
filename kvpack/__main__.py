"""``python -m kvpack``: the ``kvpack`` command line (see ``kvpack.cli``)."""

from .cli import main

if __name__ == "__main__":
    main()
