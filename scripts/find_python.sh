#!/usr/bin/env sh
# Prints the interpreter `make` builds .venv with: the first of python3.12, python3.13 that runs
# (the test path's versions: jax 0.11.2 needs Python >= 3.12, and the lent GPU machines run 3.12),
# then pyenv's installed 3.12 / 3.13 (its shims answer "command not found" for versions that are
# installed but not selected), else python3 (>= 3.10 runs `make run`; `make test` then refuses in
# one line).
for candidate in python3.12 python3.13; do
  if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
    echo "$candidate"; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root 2>/dev/null)
  for minor in 3.12 3.13; do
    for exe in "$root"/versions/"$minor".*/bin/python"$minor"; do
      if [ -x "$exe" ] && "$exe" -c 'import sys' >/dev/null 2>&1; then
        echo "$exe"; exit 0
      fi
    done
  done
fi
echo python3
