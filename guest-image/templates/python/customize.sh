#!/bin/sh
# Runs on the host, as root, on the mounted template rootfs at $1 (with /dev and /proc mounted)
# after its packages are in. Changing this file changes the template's cache key.
set -eu
root=${1:?usage: customize.sh ROOTDIR}
# Debian marks the system Python as externally managed (PEP 668): agents use `python3 -m venv`,
# which must work out of the box (ensurepip comes from python3-venv). Check it once here.
chroot "$root" sh -c 'cd /tmp && python3 -m venv /tmp/venv-check && /tmp/venv-check/bin/pip --version && rm -rf /tmp/venv-check'
