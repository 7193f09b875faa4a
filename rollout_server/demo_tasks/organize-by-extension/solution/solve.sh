#!/bin/bash
# The extension is what follows the last dot, lower-cased; no dot means "none".
set -euo pipefail
cd /app/inbox
for f in *; do
  [ -f "$f" ] || continue
  case "$f" in
    *.*) ext=$(printf '%s' "${f##*.}" | tr '[:upper:]' '[:lower:]') ;;
    *) ext=none ;;
  esac
  mkdir -p "/app/sorted/$ext"
  mv -- "$f" "/app/sorted/$ext/"
done
