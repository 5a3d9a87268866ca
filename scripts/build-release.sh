#!/usr/bin/env bash
# Builds a released version of pg_outbox from its commit into a cache outside the checkout, once,
# and prints the package directory (a tree like the system's: usr/lib/postgresql/15/lib/pg_outbox.so
# and usr/share/postgresql/15/extension/pg_outbox*). The upgrade test installs it beside the
# current build. Usage: scripts/build-release.sh 0.1.0
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: build-release.sh <version>}
# The commit of each release. The tag v<version> points at it too, but a clone may lack tags.
case "$version" in
  0.1.0) commit=38f689a2c9118b2d7532ce31307515fc8fd37ce9 ;;
  *) echo "build-release.sh: unknown release $version" >&2; exit 2 ;;
esac
cache=${PG_OUTBOX_CACHE:-/var/cache/pg_outbox}
out=$cache/releases/$version
if [ -f "$out/.built-from" ] && [ "$(cat "$out/.built-from")" = "$commit" ]; then
  echo "$out"
  exit 0
fi
export PATH="$HOME/.cargo/bin:$PATH"
src=$cache/src/$version
rm -rf "$src" "$out"
mkdir -p "$src"
git archive "$commit" | tar -x -C "$src"
# Its own target folder in the cache: built once, kept for the next run. A debug build: the test
# checks schema and behaviour, not speed.
(cd "$src" && CARGO_TARGET_DIR=$cache/target cargo pgrx package --debug \
  --pg-config /usr/lib/postgresql/15/bin/pg_config --out-dir "$out") >&2
echo "$commit" > "$out/.built-from"
rm -rf "$src"
echo "$out"
