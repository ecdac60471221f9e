#!/bin/sh
# Runs on the host, as root, on the mounted template rootfs at $1 (with /dev and /proc mounted)
# after its packages are in. Changing this file changes the template's cache key.
set -eu
root=${1:?usage: customize.sh ROOTDIR}
in_root() { chroot "$root" env DEBIAN_FRONTEND=noninteractive LC_ALL=C HOME=/tmp "$@"; }
# The toolchain must build a program with no network (GOTOOLCHAIN=local: no toolchain download).
in_root sh -c 'mkdir -p /tmp/gocheck && cd /tmp/gocheck &&
  printf "module check\n\ngo 1.21\n" > go.mod &&
  printf "package main\nimport \"fmt\"\nfunc main() { fmt.Println(\"ok\") }\n" > main.go &&
  GOTOOLCHAIN=local GOCACHE=/tmp/gocache go build -o /tmp/gocheck/check . && /tmp/gocheck/check &&
  go version && rm -rf /tmp/gocheck /tmp/gocache'
