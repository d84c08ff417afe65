"""Command line: ``python -m ddtree_ext info`` prints how the compiled core was built."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddtree_ext", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the build info of the compiled core")
    args = parser.parse_args(argv)
    if args.command == "info":
        import torch

        from ddtree_ext import build_info

        info = build_info()
        info["torch"] = torch.__version__
        print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
