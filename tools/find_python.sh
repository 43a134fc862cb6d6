#!/usr/bin/env bash
# Prints the path of a Python >= 3.12 (jax >= 0.11 needs it), checking each candidate by running
# it: a pyenv shim can sit on PATH and still refuse to run. $PYTHON, when set, is the only
# candidate. With none new enough, prints one line on stderr naming what it found and exits 1.
set -uo pipefail

need=(3 12)
if [ -n "${PYTHON:-}" ]; then
  candidates=("$PYTHON")
else
  candidates=(python3 python3.13 python3.12 python)
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for dir in /usr/local/bin /usr/bin "$root"/versions/3.1[2-9]*/bin; do
    for exe in "$dir"/python3.1[2-9] "$dir"/python; do
      [ -x "$exe" ] && candidates+=("$exe")
    done
  done
fi

found=()
for c in "${candidates[@]}"; do
  version=$("$c" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || continue
  if "$c" -c "import sys; sys.exit(sys.version_info < (${need[0]}, ${need[1]}))" 2>/dev/null; then
    command -v "$c" 2>/dev/null || echo "$c"
    exit 0
  fi
  found+=("$c $version")
done

seen=$(IFS=,; echo "${found[*]:-no runnable python}" | sed 's/,/, /g')
echo "jaxspeed needs Python >= ${need[0]}.${need[1]} (jax >= 0.11 requires it); found: $seen." \
     "Install one, or point PYTHON=/path/to/python3.12 at it" >&2
exit 1
