#!/usr/bin/env bash
# Put the venv's `adaptis` command on the user's PATH, idempotently: a symbolic link in
# ~/.local/bin (ADAPTIS_BIN_DIR to choose another directory), created if missing. The venv is
# shared by every clone and lives outside the checkout, so without this link a newcomer could
# not run the README's `adaptis ...` commands after `make run`.
#   usage: scripts/link-cli.sh VENV_BIN_DIR      (scripts/setup.sh calls it)
# A link (ours or stale) is replaced; a real file of that name (say, a `pip install --user`
# adaptis) is left alone with a warning. When the directory is not on PATH, the last line
# says how to put it there. Everything goes to stderr: setup.sh's stdout is its bin directory.
set -euo pipefail
venv_bin=${1:?usage: link-cli.sh VENV_BIN_DIR}
dest=${ADAPTIS_BIN_DIR:-$HOME/.local/bin}
target="$venv_bin/adaptis"
link="$dest/adaptis"

if [ ! -x "$target" ]; then
  echo "link-cli: $target is missing or not executable: run scripts/setup.sh" >&2
  exit 1
fi
mkdir -p "$dest"
if [ -e "$link" ] && [ ! -L "$link" ]; then
  echo "link-cli: $link exists and is not a link; left as it is (remove it to use $target)" >&2
else
  ln -sfn "$target" "$link"
  echo "link-cli: $link -> $target" >&2
fi

case ":$PATH:" in
  *":$dest:"* | *":${dest%/}/:"*) ;;
  *)
    if [ "$dest" = "$HOME/.local/bin" ]; then
      shown='$HOME/.local/bin'
    else
      shown=$dest
    fi
    echo "setup: $dest is not on your PATH; to run adaptis, run (and add to ~/.bashrc): export PATH=\"$shown:\$PATH\"" >&2
    ;;
esac
