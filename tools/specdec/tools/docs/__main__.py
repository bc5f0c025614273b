"""`python -m specdec.tools.docs [--root DIR] [--check]`: write (or check) the generated pages.

`make docs-gen` runs it. The pages: docs/reference/cli.md (argparse parsers),
docs/reference/configuration.md (the services' `setting(...)` declarations),
docs/reference/grpc.md (protos/ comments), docs/reference/helm-values.md and the chart's
helm/specdec/README.md (values.yaml).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def pages(root: Path) -> dict[Path, Callable[[], str]]:
    """Each generated page (relative to root) and the function that renders it."""
    from specdec.tools.docs import cli, configuration, grpc, helm

    return {
        Path("docs/reference/cli.md"): cli.render,
        Path("docs/reference/configuration.md"): configuration.render,
        Path("docs/reference/grpc.md"): lambda: grpc.render(root),
        Path("docs/reference/helm-values.md"): lambda: helm.render(root),
        Path("helm/specdec/README.md"): lambda: helm.readme(root),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.docs", description=__doc__)
    p.add_argument("--root", type=Path, default=Path.cwd(), help="repository root")
    p.add_argument("--check", action="store_true", help="only report stale pages (exit 1)")
    args = p.parse_args(argv)
    stale = []
    for rel, render in pages(args.root).items():
        path = args.root / rel
        text = render()
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(rel))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {rel}")
    if args.check and stale:
        print(f"stale: {', '.join(stale)} (run `make docs-gen`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
