#!/usr/bin/env bash
# Build the documentation site from docs/ into site/ (open site/index.html in a browser; it
# works from the file system, search included). Strict: a broken link, a page missing from the
# navigation or a reference that does not resolve fails the build.
#
#     bash scripts/docs.sh            # build into site/
#     bash scripts/docs.sh --serve    # or serve it at http://127.0.0.1:8000 while editing
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
# The `docs` extra of pyproject.toml (MkDocs, Material, mkdocstrings), installed once into
# .venv by name (the same as `pip install -e '.[docs]'`, without reinstalling phalanx itself).
if ! .venv/bin/python -c "import mkdocs, material, mkdocstrings, mkdocstrings_handlers.python, ruff" \
        >/dev/null 2>&1; then
    mapfile -t extra < <(.venv/bin/python -c 'import tomllib; print("\n".join(tomllib.load(
        open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
    .venv/bin/python -m pip install -q "${extra[@]}"
fi
# Material prints a notice about its future at every build; the build itself is unaffected.
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = "--serve" ]; then
    shift
    exec .venv/bin/python -m mkdocs serve --strict "$@"
fi
.venv/bin/python -m mkdocs build --strict --clean --site-dir site "$@"
echo "docs: built into site/ (open site/index.html)"
