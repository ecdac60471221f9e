#!/bin/sh
# Runs on the host, as root, on the mounted template rootfs at $1 (with /dev and /proc mounted)
# after its packages are in. Changing this file changes the template's cache key.
#
# Go comes from bookworm-backports: bookworm's own golang (1.19) is too old for most go.mod
# files of today (`go 1.21` and later). The backports source is added for the install only,
# on the mirror the base rootfs was built from (the build machine's own apt sources).
set -eu
root=${1:?usage: customize.sh ROOTDIR}
GO=1.23
in_root() { chroot "$root" env DEBIAN_FRONTEND=noninteractive LC_ALL=C HOME=/tmp "$@"; }
list="$root/etc/apt/sources.list.d/tryboxi-backports.list"
mirror=$(awk '$1 == "deb" && $3 == "bookworm" { print $2; exit }' "$root/etc/apt/sources.list")
[ -n "$mirror" ] || { echo "no bookworm source in the base rootfs's sources.list" >&2; exit 1; }
echo "deb $mirror bookworm-backports main" > "$list"
in_root apt-get -o Acquire::Retries=3 update
in_root apt-get -o Acquire::Retries=3 \
    -o 'Dpkg::Options::=--path-exclude=/usr/share/man/*' \
    -o 'Dpkg::Options::=--path-exclude=/usr/share/doc/*' \
    -o 'Dpkg::Options::=--path-include=/usr/share/doc/*/copyright' \
    install -y --no-install-recommends -t bookworm-backports "golang-$GO-go"
in_root apt-get clean
rm -f "$list"
ln -sf "../lib/go-$GO/bin/go" "$root/usr/bin/go"
ln -sf "../lib/go-$GO/bin/gofmt" "$root/usr/bin/gofmt"
# The toolchain must build a program with no network (GOTOOLCHAIN=local: no toolchain download).
in_root sh -c 'mkdir -p /tmp/gocheck && cd /tmp/gocheck &&
  printf "module check\n\ngo 1.21\n" > go.mod &&
  printf "package main\nimport \"fmt\"\nfunc main() { fmt.Println(\"ok\") }\n" > main.go &&
  GOTOOLCHAIN=local GOCACHE=/tmp/gocache go build -o /tmp/gocheck/check . && /tmp/gocheck/check &&
  go version && rm -rf /tmp/gocheck /tmp/gocache'
