#!/usr/bin/env bash
# Folders are the packages (issue 33, item 7): moves the services and the tools so that an
# import path names its file, and rewrites every path that names them.
#
#   services/gateway/loop.py  -> services/specdec/gateway/loop.py   (specdec.gateway.loop)
#   tools/bench/cli.py        -> tools/specdec/tools/bench/cli.py    (specdec.tools.bench.cli)
#
# The package roots are services/, sdk/ and tools/, three parts of one `specdec` namespace
# package (no specdec/__init__.py anywhere), found by setuptools' namespace discovery instead
# of per-package `package-dir` mappings, so mypy, an editor or a reader follows an import to
# its file.
#
# Pure `git mv` and mechanical edits of the text that names the moved paths. Idempotent: run
# it again (on a tree where some of it is done, or after a merge brought files to the old
# places) and it moves what is left and rewrites what still names an old path. Run from
# anywhere in the checkout; then reinstall the editable installs (`make install` does, as
# pyproject.toml changed) and commit the result.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

SELF=tools/relayout.sh
PARTS=(common replica drafter verifier gateway serve)

# Depth of a moved file grows by 2 (services/x -> services/specdec/x, tools/x ->
# tools/specdec/tools/x): a `Path(__file__).resolve().parents[N]` in it that finds the
# checkout's root becomes parents[N + 2]. Only files this run moves are touched.
deepen() {
    perl -pi -e 's/(Path\(__file__\)\.resolve\(\)\.parents\[)(\d+)\]/$1 . ($2 + 2) . "]"/ge' "$1"
}

# Moves every tracked file under $1 to the same place under $2.
move_tracked() {
    local src=$1 dst=$2 file target
    while IFS= read -r file; do
        [ -n "$file" ] || continue
        if [ "$file" = "$src" ]; then target=$dst; else target=$dst/${file#"$src"/}; fi
        mkdir -p "$(dirname "$target")"
        git mv "$file" "$target"
        case "$file" in *.py) deepen "$target" ;; esac
    done < <(git ls-files -- "$src")
}

# Removes what git does not track (caches) from a folder the move emptied, then the folder.
drop_if_emptied() {
    local dir=$1
    [ -d "$dir" ] || return 0
    [ -z "$(git ls-files -- "$dir")" ] || return 0
    find "$dir" -depth -type d -name __pycache__ -exec rm -rf {} +
    find "$dir" -depth -type d -empty -delete
}

# 1. services/<part>/ -> services/specdec/<part>/
for part in "${PARTS[@]}"; do
    move_tracked "services/$part" "services/specdec/$part"
    drop_if_emptied "services/$part"
done

# 2. tools/<everything but its pyproject.toml and this script> -> tools/specdec/tools/
while IFS= read -r entry; do
    case "$entry" in pyproject.toml | relayout.sh | specdec) continue ;; esac
    move_tracked "tools/$entry" "tools/specdec/tools/$entry"
    drop_if_emptied "tools/$entry"
done < <(git ls-files -- tools | cut -d/ -f2 | sort -u)

# 3. The distributions: namespace discovery under each package root.
perl -0pi -e 's{# One import namespace, `specdec` \(shared with specdec-sdk\), over the design.s folders\.\n\[tool\.setuptools\]\npackages = \[\n(?:  "specdec\.[a-z.]+",\n)+\]\n\n\[tool\.setuptools\.package-dir\]\n(?:"specdec\.[a-z]+" = "services/[a-z]+"\n)+}{# One import namespace, `specdec` (shared with specdec-sdk and specdec-tools): services/ is\n# this distribution\x27s package root, and a folder under it is the package its path names\n# (services/specdec/gateway is specdec.gateway). No specdec/__init__.py anywhere.\n[tool.setuptools.packages.find]\nwhere = ["services"]\ninclude = ["specdec.*"]\nexclude = ["*.__pycache__"]\nnamespaces = true\n}' pyproject.toml
perl -0pi -e 's{# One import namespace, `specdec`, shared with specdec-sdk and specdec-server; this\n# folder is the package specdec.tools\.\n\[tool\.setuptools\]\npackages = \[[^\]]*\]\n\n\[tool\.setuptools\.package-dir\]\n"specdec\.tools" = "\."\n}{# One import namespace, `specdec`, shared with specdec-sdk and specdec-server: this folder\n# is the package root, and specdec/tools/ under it is the package specdec.tools.\n[tool.setuptools.packages.find]\nwhere = ["."]\ninclude = ["specdec.tools", "specdec.tools.*"]\nexclude = ["*.__pycache__", "specdec.tools.bench.peer_workers"]\nnamespaces = true\n}' tools/pyproject.toml

for file in pyproject.toml tools/pyproject.toml; do
    if grep -q '^\[tool\.setuptools\.package-dir\]' "$file"; then
        echo "relayout: $file still maps packages by package-dir (its block changed?): edit it by hand" >&2
        exit 1
    fi
done

# mypy: the three package roots, and the services' packages beside the SDK.
perl -pi -e 's{^mypy_path = "sdk"$}{mypy_path = ["sdk", "services", "tools"]}' pyproject.toml

# 4. The repository's map: the tree blocks of the architecture page and the README.
perl -pi -e '
    if (/^services\/(common|replica|drafter|verifier|gateway|serve)\/ +(.*)$/) {
        $_ = ($1 eq "common" ? "services/specdec/    one package a folder, each imported as specdec.<folder>\n" : "")
           . sprintf("  %-19s%s\n", "$1/", $2);
    }
    s{^tools/               }{tools/specdec/tools/ };
' docs/concepts/architecture.md
perl -pi -e 's{^services/            common/}{services/specdec/    common/}; s{^tools/               }{tools/specdec/tools/ }' README.md

# 5. Every other text that names a moved path: docs, README, tests, tools, services, build
#    files, images, chart, CI. A name already under specdec/ is never matched again.
moved_tools=$(git ls-files -- tools/specdec/tools | cut -d/ -f4 | sort -u | grep -v '^__init__\.py$' |
    sed 's/\./\\./g' | paste -sd'|' -)
part_re=$(IFS='|'; echo "${PARTS[*]}")
mapfile -t files < <(git grep -lIE "services/($part_re)|\"services\" / \"($part_re)\"|tools/($moved_tools)" \
    -- . ":!$SELF" || true)
for file in "${files[@]}"; do
    sed -E -i \
        -e "s#(^|[^/[:alnum:]_.-])services/($part_re)\\b#\\1services/specdec/\\2#g" \
        -e "s#\"services\" / \"($part_re)\"#\"services\" / \"specdec\" / \"\\1\"#g" \
        -e "s#(^|[^/[:alnum:]_.-])tools/($moved_tools)([^[:alnum:]_]|\$)#\\1tools/specdec/tools/\\2\\3#g" \
        "$file"
done

# A moved file git placed (a merge that followed the move) was not deepened above: name any
# `parents[N]` that reaches the folder above the checkout's root from where it lies now.
while IFS=: read -r file line; do
    n=$(sed -E 's/.*Path\(__file__\)\.resolve\(\)\.parents\[([0-9]+)\].*/\1/' <<<"$line")
    depth=$(tr -cd / <<<"$file" | wc -c)
    if [ "$((n + 2))" -eq "$depth" ]; then
        echo "relayout: $file: Path(__file__).resolve().parents[$n] was the checkout's root" \
            "before the move; it is parents[$depth] now" >&2
    fi
done < <(git grep -oE 'Path\(__file__\)\.resolve\(\)\.parents\[[0-9]+\]' -- services/specdec tools/specdec)

# The formatter re-wraps a code line the longer path pushed over the line length.
mapfile -t edited_py < <(printf '%s\n' "${files[@]}" | grep '\.py$' || true)
if [ "${#edited_py[@]}" -gt 0 ]; then
    if [ -x .venv/bin/ruff ]; then
        .venv/bin/ruff format -q "${edited_py[@]}"
    else
        echo "relayout: no .venv/bin/ruff; run \`ruff format\` on: ${edited_py[*]}" >&2
    fi
fi

echo "relayout: done; reinstall the editable installs (make install) and commit the result"
