#!/usr/bin/env bash
# The documentation site, built as CI builds it: the docs extra installed into .venv (made by
# .ci/run), then `mkdocs build --strict` into a temporary directory, removed afterwards. Any
# warning (a broken link or anchor, a page left out of the nav, a docstring the API reference
# cannot read) fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    echo "docs: no .venv here; make it first (python3 -m venv .venv)" >&2
    exit 1
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[docs]'

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# NO_MKDOCS_2_WARNING: Material prints a banner about MkDocs 2 on every build.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
echo "docs: mkdocs build --strict is clean"
