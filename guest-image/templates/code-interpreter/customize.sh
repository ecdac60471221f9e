#!/bin/sh
# Runs on the host, as root, on the mounted template rootfs at $1 (with /dev and /proc mounted)
# after its packages are in. This file and server.py beside it are the template's cache key.
set -eu
root=${1:?usage: customize.sh ROOTDIR}
here=$(dirname "$0")
# The E2B face starts this as `user` when it creates a sandbox from `code-interpreter-v1`.
install -d -o root -g root -m 0755 "$root/opt/tryboxi/interpreter"
install -o root -g root -m 0755 "$here/server.py" "$root/opt/tryboxi/interpreter/server.py"
# The server must at least compile and find its libraries, and the native kernel must start.
chroot "$root" env LC_ALL=C HOME=/tmp sh -c '
  python3 -m py_compile /opt/tryboxi/interpreter/server.py &&
  rm -rf /opt/tryboxi/interpreter/__pycache__ &&
  python3 -c "import ipykernel, jupyter_client; print(ipykernel.__version__, jupyter_client.__version__)"'
# matplotlib builds its font cache on first import (tens of seconds under TCG): build it now,
# as `user` (uid 1000, who runs the kernels) in that user's cache directory.
chroot --userspec=1000:1000 "$root" env LC_ALL=C HOME=/home/user MPLBACKEND=Agg \
  python3 -c "import matplotlib.pyplot as plt; plt.figure(); print('matplotlib', plt.matplotlib.__version__)"
test -d "$root/home/user/.cache/matplotlib"
