#!/bin/sh
# Runs on the host, as root, on the mounted template rootfs at $1 (with /dev and /proc mounted)
# after its packages are in. Changing this file changes the template's cache key.
set -eu
root=${1:?usage: customize.sh ROOTDIR}
# The toolchain must build a crate offline (its target dir and cargo home on the build's tmpfs).
chroot "$root" env LC_ALL=C HOME=/tmp CARGO_HOME=/tmp/cargo-home sh -c '
  cd /tmp && cargo new --vcs none --quiet tryboxi-check && cd tryboxi-check &&
  cargo build --offline --quiet && ./target/debug/tryboxi-check &&
  rustc --version && cargo --version && cd /tmp && rm -rf tryboxi-check cargo-home'
