"""Regenerate the dashboards' JSON in this directory from ringray.dashboards (the code).

    python dashboards/build.py             # rewrites dashboards/ringray-*.json
    python dashboards/build.py --out DIR   # writes them elsewhere

The JSON files are committed; tests/test_dashboards.py checks they equal a fresh build.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ringray.dashboards.build import write_dashboards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent),
                        help="directory to write into (default: this script's directory)")
    args = parser.parse_args()
    for path in write_dashboards(args.out):
        print(path)


if __name__ == "__main__":
    main()
