"""`deepinfer-inspect`: the rank-inspection CLI. Not built yet; it lands with its issue."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("deepinfer-inspect is not implemented yet: it lands with the rank-inspection issue",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
