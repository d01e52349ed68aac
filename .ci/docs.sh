#!/usr/bin/env bash
# The documentation site, built as CI builds it: the docs extra in .venv (made by .ci/run),
# then `mkdocs build --strict` into a temporary directory, removed afterwards. Any warning (a
# broken link or anchor, a page left out of the nav, a docstring the API reference cannot read)
# fails the build.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
    echo "docs: no .venv here; make it first (python3 -m venv .venv)" >&2
    exit 1
fi
# Installed unless it is there already (.ci/run installs it first: an editable reinstall of
# twiceshy would pull the package away from the benchmarks running beside this build).
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[docs]'
fi

site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
# NO_MKDOCS_2_WARNING: Material prints a banner about MkDocs 2 on every build.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site"
echo "docs: mkdocs build --strict is clean"
