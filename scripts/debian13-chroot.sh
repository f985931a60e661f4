# Sourced, not run: the Debian 13 (trixie) chroot helpers shared by scripts/libtorch2-chroot.sh
# (CPU libtorch 2.6) and scripts/cuda-check.sh (CUDA libtorch 2.6, contrib and non-free).
#
# chroot_setup ROOT COMPONENTS PACKAGES [DEBCONF]
#                                        debootstrap ROOT once (COMPONENTS e.g. "main" or
#                                        "main,contrib,non-free"), then install what PACKAGES
#                                        lacks, with the debconf-set-selections lines DEBCONF
#                                        answered first; idempotent
# chroot_run ROOT CMD [ARG..]            run CMD inside, in the current directory (bind-mounted
#                                        at the same path, and left mounted for the next run);
#                                        does not return
# chroot_release ROOT DIR                unmount what chroot_run left mounted for DIR and the
#                                        directories under it
#
# Needs root and a Debian mirror that has trixie: the mirror this machine's apt already uses
# (the first URIs: / deb line of its sources), or DEBIAN_MIRROR=<url>.

# The Debian mirror this machine's apt already uses (first URIs/deb line of its sources).
debian_mirror() {
  [ -n "${DEBIAN_MIRROR:-}" ] && { echo "$DEBIAN_MIRROR"; return; }
  { awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null
    awk '/^deb / {print $2; exit}' /etc/apt/sources.list 2>/dev/null; } | head -n1
}

chroot_mounts() {
  local root=$1 d
  # The root a mount point of its own: `ip netns exec` (the two-hosts test) remounts / as a
  # slave, which fails on a directory that is not one.
  mountpoint -q "$root" || mount --rbind "$root" "$root"  # with what is mounted inside
  for d in proc dev dev/pts; do
    mountpoint -q "$root/$d" || mount --bind "/$d" "$root/$d"
  done
  # /sys with what is mounted under it: Debian 13's slurmd refuses to start without
  # /sys/fs/cgroup (real_slurm). A slave copy: unmounting it later cannot unmount the host's.
  if ! mountpoint -q "$root/sys"; then
    mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"
  fi
  mkdir -p "$root/dev/shm"; mountpoint -q "$root/dev/shm" || mount -t tmpfs tmpfs "$root/dev/shm"
  # The host's names: torchrun's c10d rendezvous tells workers its host name (getfqdn()), which
  # must resolve inside the chroot too. A minbase trixie has no /etc/hosts to mount over.
  [ -e "$root/etc/hosts" ] || touch "$root/etc/hosts"
  grep -q " $root/etc/hosts " /proc/mounts || mount --bind /etc/hosts "$root/etc/hosts"
}

chroot_setup() {
  local root=$1 components=$2 packages=$3 debconf=${4:-} missing p
  command -v debootstrap >/dev/null || { apt-get update -qq; apt-get install -y -qq debootstrap; }
  if [ ! -x "$root/usr/bin/apt-get" ]; then
    debootstrap --variant=minbase --components="$components" trixie "$root" "$(debian_mirror)"
  fi
  # Installing a daemon (munge, slurmd, ...) must not start it inside the chroot: it would outlive
  # the install, holding the chroot's mounts (the tests start their own, e.g. real_slurm).
  if [ ! -e "$root/usr/sbin/policy-rc.d" ]; then
    printf '#!/bin/sh\n# scripts/debian13-chroot.sh: no daemon starts on install\nexit 101\n' \
      > "$root/usr/sbin/policy-rc.d"
    chmod +x "$root/usr/sbin/policy-rc.d"
  fi
  # A chroot made earlier with fewer components (e.g. by libtorch2-chroot.sh) gains the others.
  for p in ${components//,/ }; do
    grep -qw -- "$p" "$root/etc/apt/sources.list" 2>/dev/null ||
      echo "deb $(debian_mirror) trixie ${components//,/ }" > "$root/etc/apt/sources.list"
  done
  chroot_mounts "$root"
  missing=
  for p in $packages; do
    chroot "$root" dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" ||
      missing="$missing $p"
  done
  [ -z "$debconf" ] || echo "$debconf" | chroot "$root" debconf-set-selections
  # A package whose triggers another apt run inside has left pending counts as missing here:
  # the install then waits for that run's dpkg lock instead of failing.
  if [ -n "$missing" ]; then
    chroot "$root" bash -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends $packages >/dev/null"
  fi
}

chroot_run() {
  local root=$1 here
  shift
  chroot_mounts "$root"
  here=$(pwd -P)
  mkdir -p "$root$here"
  # A mount left from an earlier directory of the same name, since deleted (a clone removed and
  # made again at the same path) still shows the old, empty one: drop it and mount this one.
  if mountpoint -q "$root$here" &&
     [ "$(stat -c %d:%i "$here")" != "$(stat -c %d:%i "$root$here" 2>/dev/null)" ]; then
    umount -l "$root$here"
  fi
  mountpoint -q "$root$here" || mount --bind "$here" "$root$here"
  # PyTorch 2.6 as Debian builds it has no libuv: TCPStore must use its classic server.
  exec chroot "$root" env USE_LIBUV=0 bash -c 'cd "$0" && exec "$@"' "$here" "$@"
}

# The bind mounts chroot_run keeps (one per directory it ran in) hold those directories busy:
# deleting one (a clone, a worktree) fails with "Device or resource busy" until they go. Deepest
# first; lazily, so a command still running inside keeps what it uses.
chroot_release() {
  local root=$1 here m
  here=$(realpath -m "$2")
  [ "$here" != / ] || { echo "chroot_release: not /: name the directory that ran inside" >&2; return 2; }
  awk '{print $2}' /proc/mounts | while read -r m; do
    m=$(printf '%b' "$m")  # /proc/mounts writes a space as \040
    case "$m" in "$root$here" | "$root$here"/*) echo "$m" ;; esac
  done | sort -r | while read -r m; do
    umount -l "$m" && echo "released $m"
  done
}
