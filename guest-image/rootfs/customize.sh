#!/bin/sh
# Customizes the unpacked guest rootfs at $1 (run on the host, as root, after mmdebstrap).
# Changing this file changes the rootfs cache key. The guest agent (our /init in the
# initramfs) is PID 1, so no getty, systemd or other init is configured here.
set -eu
root=${1:?usage: customize.sh ROOTDIR}
[ -d "$root/etc" ] || { echo "customize.sh: $root does not look like a rootfs" >&2; exit 1; }

echo tryboxi > "$root/etc/hostname"
cat > "$root/etc/hosts" <<'HOSTS'
127.0.0.1	localhost
127.0.1.1	tryboxi
::1	localhost ip6-localhost ip6-loopback
ff02::1	ip6-allnodes
ff02::2	ip6-allrouters
HOSTS

# Placeholder: the guest agent writes the real resolver at boot.
rm -f "$root/etc/resolv.conf"
cat > "$root/etc/resolv.conf" <<'RESOLV'
# Written by the tryboxi guest agent at boot.
RESOLV

# Where the host's project is synced to.
mkdir -p "$root/workspace"
chmod 0755 "$root/workspace"

cat > "$root/etc/fstab" <<'FSTAB'
# Mounts are done by the tryboxi guest agent (PID 1).
FSTAB

# Empty machine-id: each VM is a fresh machine.
: > "$root/etc/machine-id"

grep -q '^root:x:0:0:' "$root/etc/passwd" || { echo "customize.sh: no root in /etc/passwd" >&2; exit 1; }

# An unprivileged user for `exec -u user` (uid/gid 1000, like most dev images) with
# passwordless sudo. Written into the files directly (the host's useradd would read the host's
# login.defs); no password: `*` in shadow.
if ! grep -q '^user:' "$root/etc/passwd"; then
    echo 'user:x:1000:1000:user:/home/user:/bin/bash' >> "$root/etc/passwd"
    echo 'user:x:1000:' >> "$root/etc/group"
    echo 'user:*:19000:0:99999:7:::' >> "$root/etc/shadow"
    [ -f "$root/etc/gshadow" ] && echo 'user:!::' >> "$root/etc/gshadow"
fi
mkdir -p "$root/home/user"
cp -a "$root/etc/skel/." "$root/home/user/" 2>/dev/null || true
chown -R 1000:1000 "$root/home/user"
chmod 0755 "$root/home/user"
mkdir -p "$root/etc/sudoers.d"
echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > "$root/etc/sudoers.d/user"
chmod 0440 "$root/etc/sudoers.d/user"
chroot "$root" /usr/sbin/visudo -cf /etc/sudoers.d/user >/dev/null \
    || { echo "customize.sh: /etc/sudoers.d/user does not validate" >&2; exit 1; }

# Shrink: package lists and caches are re-fetched by `apt-get update` inside a sandbox.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin \
       "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/debconf/*-old \
       "$root"/var/log/*.log "$root"/var/log/apt/* \
       "$root"/usr/share/man/* "$root"/usr/share/info/*
mkdir -p "$root/var/lib/apt/lists/partial"
