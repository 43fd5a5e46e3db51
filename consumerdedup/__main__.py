"""``python -m consumerdedup``: the same as the ``consumerdedup`` command."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
