"""``python -m modelgraft``: the same command line as the ``modelgraft`` console script."""

from __future__ import annotations

from modelgraft.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
