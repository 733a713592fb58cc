#!/usr/bin/env bash
# An emulated Raspberry Pi on an x86_64 Debian host: an arm64 Debian bookworm userland run under qemu-user,
# with the aarch64 wheels fedge's device needs, and this checkout's code run inside it (no chroot).
#
#   scripts/emulated_pi.sh setup                 # provision, idempotent; everything is cached under the Pi dir
#   scripts/emulated_pi.sh run python3 -m firmware_tests --runtime executorch
#   scripts/emulated_pi.sh run python3 -m coordinator.cli device --config device.toml
#   scripts/emulated_pi.sh info                  # paths, CPU, disk used
#   scripts/emulated_pi.sh binfmt                # register qemu-aarch64 with binfmt_misc (setup does it too)
#   scripts/emulated_pi.sh check-native [F.pte]  # cross-compile a toolchain check (ExecuTorch runtime) and run it
#   scripts/emulated_pi.sh build-native          # cross-compile clients/native for aarch64, install it in the Pi
#   scripts/emulated_pi.sh native --id pi-1 --data pi-1.npz --broker mqtt://127.0.0.1:1883 --state-dir DIR
#                                                # run the installed fedge-native (no Python, no torch)
#
# Environment:
#   FEDGE_PI_DIR       cache dir (default: <checkout>/runs/emulated-pi): rootfs/, wheels/, site/, native/
#   FEDGE_PI_CPU       the emulated core: cortex-a76 (Pi 5, default), cortex-a72 (Pi 4), cortex-a53 (Pi 3), max
#   FEDGE_PI_CPUS      how many cores the fake /sys and /proc/cpuinfo show (default 2)
#   FEDGE_PI_MIRROR    Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   FEDGE_HOST_PYTHON  host Python whose pip fetches the wheels (default: <checkout>/.venv/bin/python, else python3)
#   FEDGE_NATIVE_SRC   the native device's sources (default: <checkout>/clients/native)
#   FEDGE_BINFMT_DIR   where binfmt_misc is mounted (default /proc/sys/fs/binfmt_misc; another directory is
#                      only written through its register file, never with update-binfmts or mount)
#
# Needs root (apt-get, mounting binfmt_misc). Every step checks what it needs first, and any failure ends the
# script with one "[emulated-pi] error: ..." line on stderr. Why each step is the way it is: docs/raspberry-pi.md.
set -eEuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PI_DIR="${FEDGE_PI_DIR:-$ROOT/runs/emulated-pi}"
ROOTFS="$PI_DIR/rootfs"
WHEELS="$PI_DIR/wheels"
SITE="$PI_DIR/site"
CPU="${FEDGE_PI_CPU:-cortex-a76}"
NCPUS="${FEDGE_PI_CPUS:-2}"
MIRROR="${FEDGE_PI_MIRROR:-http://deb.debian.org/debian}"
BINFMT_DEFAULT=/proc/sys/fs/binfmt_misc
BINFMT="${FEDGE_BINFMT_DIR:-$BINFMT_DEFAULT}"
# the native device (clients/native, C++): cross-compiled on the host, installed in the rootfs under
# NATIVE_PREFIX with only the ExecuTorch runtime libraries and libmosquitto beside it
NATIVE="$PI_DIR/native"
NATIVE_SRC="${FEDGE_NATIVE_SRC:-$ROOT/clients/native}"
NATIVE_PREFIX=/opt/fedge-native
ET_A64="$NATIVE/executorch-aarch64/executorch"   # the aarch64 wheel, unpacked: lib/, include/, share/cmake/
# unpacked into $NATIVE/sysroot: libmosquitto1 (needs only libc6 and libssl3, both in the rootfs) is also installed
# beside the device; the header-only msgpack-cxx (its CMake config is per architecture and wants Boost's) and
# nlohmann-json are only built against
ARM64_DEBS=(libmosquitto1 libmosquitto-dev libmsgpack-cxx-dev libboost1.74-dev nlohmann-json3-dev)
CROSS_PACKAGES=(g++-aarch64-linux-gnu cmake pkg-config patchelf libmsgpack-cxx-dev nlohmann-json3-dev)
TOOLCHAIN="$ROOT/scripts/pi-native/aarch64-linux-gnu.cmake"
if [[ -n "${FEDGE_HOST_PYTHON:-}" ]]; then HOST_PY="$FEDGE_HOST_PYTHON"
elif [[ -x "$ROOT/.venv/bin/python" ]]; then HOST_PY="$ROOT/.venv/bin/python"
else HOST_PY=python3; fi

# What a device gets. pip evaluates environment markers against the *host* (x86_64), so executorch's own
# requirements cannot be resolved for aarch64: it would pull coremltools and scikit-learn, which its
# markers reserve for Darwin and x86_64 Linux, and coremltools has no aarch64 wheel. executorch is
# therefore installed --no-deps, beside its Requires-Dist (1.5.1) minus those two and minus hydra-core and
# omegaconf, which need antlr4-python3-runtime 4.9, an sdist only (a Pi's pip would build it; fedge's
# device never imports them). torch's markers are platform_system == "Linux" only, so its CUDA
# dependencies resolve as they would on a Pi.
DEVICE_REQS=(numpy msgpack paho-mqtt torch==2.13.0)
ET_REQ=executorch==1.5.1
ET_DEPS=(expecttest flatbuffers hypothesis kgb mpmath==1.3.0 "numpy>=2.0.0" packaging "pandas>=2.2.2" parameterized
         py-cpuinfo requests "pytorch-tokenizers>=1.5.0" "torchao>=0.18.0,<0.19" pyyaml ruamel.yaml sympy tabulate
         "typing-extensions>=4.10.0")
PLATFORMS=(--platform manylinux2014_aarch64)
for v in $(seq 17 36); do PLATFORMS+=(--platform "manylinux_2_${v}_aarch64"); done
PIP_TARGET_ARGS=(--only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 "${PLATFORMS[@]}")

say() { echo "[emulated-pi] $*" >&2; }
die() { say "error: $*"; exit 1; }
bad() { say "error: $*"; exit 2; }  # a person's bad input (a command, an environment variable)
# Anything that fails without its own check still ends with one line naming the command (only in the
# script's own shell: a failure inside $(...) or ( ... ) is reported once, by the line that ran it).
trap 'rc=$?; if [[ $BASH_SUBSHELL -eq 0 ]]; then say "error: line $LINENO: \"$BASH_COMMAND\" exited $rc"; fi; exit $rc' ERR
case "$CPU" in cortex-a76|cortex-a72|cortex-a53|max) ;; *) bad "FEDGE_PI_CPU=$CPU: use cortex-a76, cortex-a72, cortex-a53 or max" ;; esac
[[ "$NCPUS" =~ ^[1-9][0-9]*$ ]] || bad "FEDGE_PI_CPUS=$NCPUS: give a number of cores (1, 2, 4)"
now() { date +%s.%N; }
# `done_in NAME T0`: the line benchmarks/emulated_pi.py parses for its per-step timings
done_in() { say "$1 done in $(awk -v a="$2" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}') s"; }
# the host pip; this machine's pip config names local indexes that have no aarch64 files: drop its warnings
host_pip() {
    "$HOST_PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
reqs_key() { printf '%s\n' "${DEVICE_REQS[@]}" "$ET_REQ" "${ET_DEPS[@]}" "${PLATFORMS[@]}" | sha256sum | cut -c1-16; }

step_host_packages() {
    local t0; t0=$(now)
    if command -v qemu-aarch64-static >/dev/null && command -v debootstrap >/dev/null \
            && command -v update-binfmts >/dev/null; then
        say "host packages: present"; return
    fi
    [[ $EUID -eq 0 ]] || die "run as root (apt-get install qemu-user-static binfmt-support debootstrap)"
    command -v apt-get >/dev/null || die "no apt-get: install qemu-user-static, binfmt-support and debootstrap by hand"
    say "host packages: apt-get install qemu-user-static binfmt-support debootstrap"
    apt-get update -q >/dev/null || die "apt-get update failed (network or apt sources; see above)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user-static binfmt-support debootstrap >/dev/null \
        || die "apt-get install qemu-user-static binfmt-support debootstrap failed (see above)"
    command -v qemu-aarch64-static >/dev/null || die "apt-get installed qemu-user-static but there is no qemu-aarch64-static"
    done_in host_packages "$t0"
}

# ExecuTorch runs its bundled flatc (an aarch64 binary) as a subprocess when it builds a zero weights
# file; that exec only works through binfmt_misc. QEMU_LD_PREFIX/QEMU_CPU reach those children via the env.
ensure_binfmt() {
    if [[ ! -e "$BINFMT/status" ]]; then
        [[ "$BINFMT" == "$BINFMT_DEFAULT" ]] || die "FEDGE_BINFMT_DIR=$BINFMT: no binfmt_misc there (no status file)"
        [[ $EUID -eq 0 ]] || die "binfmt_misc is not mounted; as root: mount -t binfmt_misc binfmt_misc $BINFMT"
        mount -t binfmt_misc binfmt_misc "$BINFMT" \
            || die "cannot mount binfmt_misc at $BINFMT (in a container: run it --privileged, or mount it on the host)"
    fi
    local reg="$BINFMT/qemu-aarch64" interp=""
    # a registration can outlive its interpreter (qemu-user-static removed): then register again
    if [[ -f "$reg" ]]; then
        interp=$(sed -n 's/^interpreter //p' "$reg") || die "cannot read $reg"
        if grep -q '^enabled' "$reg" && [[ -x "$interp" ]]; then return 0; fi
    fi
    local what="not registered"
    [[ -f "$reg" ]] && what="registered with interpreter '${interp:-none}', which is missing or disabled"
    [[ $EUID -eq 0 ]] || die "qemu-aarch64 is $what in binfmt_misc; as root: $0 binfmt (or update-binfmts --enable qemu-aarch64)"
    local qemu; qemu=$(command -v qemu-aarch64-static) || die "no qemu-aarch64-static: apt-get install qemu-user-static"
    # writes to binfmt_misc: the shell's own message (the kernel's reason) goes into the one error line
    local err
    if [[ -f "$reg" ]]; then
        err=$({ echo -1 > "$reg"; } 2>&1) || die "cannot remove the stale registration $reg: ${err##*: }"
    fi
    # Debian's way first (binfmt-support's database, the package's flags); then the kernel's own interface,
    # with qemu's aarch64 ELF magic and mask (qemu's scripts/qemu-binfmt-conf.sh) and F: the interpreter is
    # opened now, so it works inside the rootfs too. Another FEDGE_BINFMT_DIR is never given to update-binfmts.
    if [[ "$BINFMT" == "$BINFMT_DEFAULT" ]] && command -v update-binfmts >/dev/null; then
        update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    fi
    if [[ ! -f "$reg" ]]; then
        [[ -e "$BINFMT/register" ]] || die "no $BINFMT/register: cannot register qemu-aarch64"
        err=$({ printf '%s\n' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:'"$qemu"':F' \
            > "$BINFMT/register"; } 2>&1) \
            || die "the kernel refused the qemu-aarch64 registration ($BINFMT/register): ${err##*: }"
    fi
    [[ -f "$reg" ]] && grep -q '^enabled' "$reg" \
        || die "qemu-aarch64 is still not registered in $BINFMT after registering it (update-binfmts, $BINFMT/register)"
    say "binfmt: qemu-aarch64 registered ($qemu)"
}

# debootstrap's first stage only downloads and unpacks the essentials; instead of its second stage (7.5 min
# under emulation) every downloaded .deb is unpacked with dpkg -x: nothing is configured, which Python
# does not need.
step_rootfs() {
    if [[ -f "$ROOTFS/.fedge-ready" ]]; then say "rootfs: cached ($ROOTFS)"; return; fi
    local t0; t0=$(now)
    [[ $EUID -eq 0 ]] || die "run as root (debootstrap unpacks device nodes and owners into the rootfs)"
    command -v debootstrap >/dev/null || die "no debootstrap: apt-get install debootstrap"
    rm -rf "$ROOTFS"
    mkdir -p "$PI_DIR" || die "cannot create $PI_DIR"
    say "rootfs: debootstrap --foreign --arch=arm64 --variant=minbase --include=python3 bookworm"
    debootstrap --foreign --arch=arm64 --variant=minbase --include=python3 bookworm "$ROOTFS" "$MIRROR" \
        > "$PI_DIR/debootstrap.log" 2>&1 || { tail -20 "$PI_DIR/debootstrap.log" >&2; die "debootstrap failed"; }
    done_in debootstrap "$t0"
    local t1 debs; t1=$(now)
    debs=("$ROOTFS"/var/cache/apt/archives/*.deb)
    [[ -e "${debs[0]}" ]] || die "debootstrap left no .debs in $ROOTFS/var/cache/apt/archives (log: $PI_DIR/debootstrap.log)"
    say "rootfs: dpkg -x ${#debs[@]} packages"
    for d in "${debs[@]}"; do dpkg -x "$d" "$ROOTFS" || die "dpkg -x $(basename "$d") failed"; done
    rm -f "$ROOTFS"/var/cache/apt/archives/*.deb
    [[ -x "$ROOTFS/usr/bin/python3.11" ]] || die "no python3.11 in the rootfs"
    touch "$ROOTFS/.fedge-ready"
    done_in unpack "$t1"
}

step_wheels() {
    local key; key=$(reqs_key)
    if [[ -f "$WHEELS/.fedge-$key" ]]; then say "wheels: cached ($WHEELS, $(du -sh "$WHEELS" | cut -f1))"; return; fi
    local t0; t0=$(now)
    "$HOST_PY" -m pip --version >/dev/null 2>&1 \
        || die "$HOST_PY has no pip: set FEDGE_HOST_PYTHON to a Python 3 with pip (it fetches the aarch64 wheels)"
    mkdir -p "$WHEELS" || die "cannot create $WHEELS"
    say "wheels: pip download for aarch64: ${DEVICE_REQS[*]} $ET_REQ (+ its deps); torch brings ~2 GB of CUDA wheels"
    host_pip download -q --no-cache-dir --dest "$WHEELS" "${PIP_TARGET_ARGS[@]}" \
        "${DEVICE_REQS[@]}" "${ET_DEPS[@]}" || die "pip download of the aarch64 wheels failed (network or index; see above)"
    host_pip download -q --no-cache-dir --no-deps --dest "$WHEELS" "${PIP_TARGET_ARGS[@]}" "$ET_REQ" \
        || die "pip download of $ET_REQ for aarch64 failed (see above)"
    rm -f "$WHEELS"/.fedge-*
    touch "$WHEELS/.fedge-$key"
    done_in download "$t0"
    say "wheels: $(ls "$WHEELS"/*.whl | wc -l) files, $(du -sh "$WHEELS" | cut -f1)"
}

step_site() {
    local key; key=$(reqs_key)
    if [[ -f "$SITE/.fedge-$key" ]]; then say "site: cached ($SITE, $(du -sh "$SITE" | cut -f1))"; return; fi
    local t0; t0=$(now)
    [[ -f "$WHEELS/.fedge-$key" ]] || die "no downloaded wheels in $WHEELS: the wheels step has not finished"
    rm -rf "$SITE"
    say "site: pip install --target (from the cached wheels only)"
    # --no-warn-conflicts: pip would compare the target with the *host's* installed packages
    local inst=(install -q --no-index --find-links "$WHEELS" --target "$SITE" --no-warn-conflicts
                --root-user-action=ignore "${PIP_TARGET_ARGS[@]}")
    host_pip "${inst[@]}" "${DEVICE_REQS[@]}" "${ET_DEPS[@]}" || die "pip install --target $SITE failed (see above)"
    # into the same target: pip warns that bin/ already exists and skips it (executorch's console scripts)
    host_pip "${inst[@]}" --no-deps "$ET_REQ" 2>&1 | grep -v "already exists" >&2 || true
    [[ -d "$SITE/executorch" && -d "$SITE/torch" ]] || die "install incomplete: no torch or executorch in $SITE"
    touch "$SITE/.fedge-$key"
    done_in install "$t0"
    say "site: $(du -sh "$SITE" | cut -f1)"
}

# CPU identity. qemu-user maps absolute paths into QEMU_LD_PREFIX when the file exists there, so these fake
# files shadow the host's. The host's /sys (x86 topology) makes `import torch` segfault; with no /sys at all,
# cpuinfo cannot count cores and XNNPACK fails to initialise (status 0x5).
write_cpu_identity() {
    local midr features
    case "$CPU" in
        cortex-a76|max) midr=0x00000000414fd0b1  # Pi 5 (BCM2712): Cortex-A76 r4p1
            features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp" ;;
        cortex-a72) midr=0x00000000410fd083      # Pi 4 (BCM2711): Cortex-A72 r0p3, no crypto extensions
            features="fp asimd evtstrm crc32 cpuid" ;;
        cortex-a53) midr=0x00000000410fd034      # Pi 3 / Zero 2 W: Cortex-A53 r0p4
            features="fp asimd evtstrm crc32 cpuid" ;;
        *) bad "FEDGE_PI_CPU=$CPU: use cortex-a76, cortex-a72, cortex-a53 or max" ;;
    esac
    [[ -d "$ROOTFS/usr" ]] || die "no rootfs at $ROOTFS: run $0 setup first"
    local cpudir="$ROOTFS/sys/devices/system/cpu" last=$((NCPUS - 1)) i
    rm -rf "$ROOTFS/sys"
    mkdir -p "$cpudir" "$ROOTFS/proc"
    for f in possible present online; do echo "0-$last" > "$cpudir/$f"; done
    : > "$ROOTFS/proc/cpuinfo"
    for ((i = 0; i < NCPUS; i++)); do
        mkdir -p "$cpudir/cpu$i/regs/identification"
        echo "$midr" > "$cpudir/cpu$i/regs/identification/midr_el1"
        printf 'processor\t: %d\nBogoMIPS\t: 108.00\nFeatures\t: %s\nCPU implementer\t: 0x41\n' "$i" "$features" \
            >> "$ROOTFS/proc/cpuinfo"
        printf 'CPU architecture: 8\nCPU variant\t: 0x%x\nCPU part\t: 0x%s\nCPU revision\t: %d\n\n' \
            "$(( (midr >> 20) & 0xf ))" "$(printf '%03x' $(( (midr >> 4) & 0xfff )))" "$(( midr & 0xf ))" \
            >> "$ROOTFS/proc/cpuinfo"
    done
    echo "$CPU $NCPUS" > "$ROOTFS/.fedge-cpu"
}

# ---- the native device --------------------------------------------------------------------------------

step_cross_packages() {
    local missing=() p
    for p in "${CROSS_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [[ ${#missing[@]} -eq 0 ]] && { say "cross packages: present"; return; }
    [[ $EUID -eq 0 ]] || die "run as root (apt-get install ${missing[*]})"
    local t0; t0=$(now)
    say "cross packages: apt-get install ${missing[*]}"
    apt-get update -q >/dev/null || die "apt-get update failed (network or apt sources; see above)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed (see above)"
    done_in cross_packages "$t0"
}

# The aarch64 executorch wheel, without its dependencies (torch): its lib/ is the C++ runtime, include/ and
# share/cmake/ are what CMake builds against. From the wheels cache when `setup` filled it, else downloaded.
step_et_aarch64() {
    if [[ -f "$ET_A64/share/cmake/executorch-config.cmake" ]]; then say "aarch64 executorch: cached ($ET_A64)"; return; fi
    local t0; t0=$(now) links=()
    [[ -d "$WHEELS" ]] && links=(--find-links "$WHEELS")
    rm -rf "$NATIVE/executorch-aarch64"
    say "aarch64 executorch: pip install --no-deps --target (the runtime only; no torch)"
    host_pip install -q --no-deps --target "$NATIVE/executorch-aarch64" --no-warn-conflicts --root-user-action=ignore \
        "${links[@]}" "${PIP_TARGET_ARGS[@]}" "$ET_REQ" 2>&1 | grep -v "already exists" >&2 || true
    [[ -f "$ET_A64/lib/libexecutorch.so" ]] || die "no lib/libexecutorch.so in the aarch64 executorch wheel"
    done_in et_aarch64 "$t0"
}

# The arm64 .debs of the C libraries (libmosquitto), through a private apt state for arm64 under
# $NATIVE/apt: the host's dpkg gets no foreign architecture and its apt lists are untouched.
step_arm64_debs() {
    local key; key=$(printf '%s\n' "${ARM64_DEBS[@]}" "$MIRROR" | sha256sum | cut -c1-16)
    if [[ -f "$NATIVE/sysroot/.fedge-$key" ]]; then say "arm64 debs: cached ($NATIVE/sysroot)"; return; fi
    local t0; t0=$(now) d="$NATIVE/apt"
    rm -rf "$d" "$NATIVE/sysroot"
    mkdir -p "$d/lists/partial" "$d/archives/partial" "$NATIVE/sysroot"
    local sec="${MIRROR%/debian}/debian-security"
    printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-security main\n' \
        "$MIRROR" "$MIRROR" "$sec" > "$d/sources.list"
    : > "$d/status"
    local apt=(apt-get -q -o "Dir::Etc::SourceList=$d/sources.list" -o Dir::Etc::SourceParts=/dev/null
               -o "Dir::State::Lists=$d/lists" -o "Dir::State::status=$d/status" -o "Dir::Cache=$d"
               -o "Dir::Cache::archives=$d/archives" -o APT::Architecture=arm64 -o APT::Architectures::=arm64
               -o Debug::NoLocking=1 -o Acquire::Languages=none -o APT::Sandbox::User=root)
    say "arm64 debs: apt-get download ${ARM64_DEBS[*]} (arm64, private apt state in $d)"
    "${apt[@]}" update >/dev/null || die "apt-get update (arm64) failed"
    ( cd "$d/archives" && "${apt[@]}" download "${ARM64_DEBS[@]}" >/dev/null ) || die "apt-get download failed"
    local deb; for deb in "$d"/archives/*_arm64.deb; do dpkg -x "$deb" "$NATIVE/sysroot"; done
    rm -rf "$d/lists" "$d"/*.bin
    touch "$NATIVE/sysroot/.fedge-$key"
    done_in arm64_debs "$t0"
}

# `cross_build SRC BUILD TARGET...`: configure with the aarch64 toolchain and build the targets
cross_build() {
    local src=$1 build=$2; shift 2
    local targets=(); local t; for t in "$@"; do targets+=(--target "$t"); done
    # a build dir configured from other sources (FEDGE_NATIVE_SRC) is started afresh
    if [[ -f "$build/CMakeCache.txt" ]] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$src" "$build/CMakeCache.txt"; then
        rm -rf "$build"
    fi
    FEDGE_ARM64_SYSROOT="$NATIVE/sysroot" FEDGE_ARM64_RUNTIME_ROOT="$ROOTFS" \
        cmake -S "$src" -B "$build" --toolchain "$TOOLCHAIN" -DCMAKE_BUILD_TYPE=Release \
              -DCMAKE_PREFIX_PATH="$ET_A64" > "$build.configure.log" 2>&1 \
        || { tail -30 "$build.configure.log" >&2; return 1; }
    FEDGE_ARM64_SYSROOT="$NATIVE/sysroot" FEDGE_ARM64_RUNTIME_ROOT="$ROOTFS" \
        cmake --build "$build" -j"${JOBS:-2}" "${targets[@]}" > "$build.build.log" 2>&1 \
        || { grep -E "error|Error" "$build.build.log" | head -30 >&2; return 1; }
}

# `install_native BIN`: BIN (stripped, its rpath made $ORIGIN/../lib) into $ROOTFS$NATIVE_PREFIX/bin, and into
# lib/ the shared libraries it needs that the base system (the rootfs) does not have: the ExecuTorch runtime
# libraries from the aarch64 wheel and libmosquitto from the arm64 .debs, followed transitively.
install_native() {
    local bin=$1 dest="$ROOTFS$NATIVE_PREFIX" name
    rm -rf "$dest"
    mkdir -p "$dest/bin" "$dest/lib"
    cp "$bin" "$dest/bin/"
    name=$(basename "$bin")
    aarch64-linux-gnu-strip --strip-unneeded "$dest/bin/$name"
    patchelf --set-rpath '$ORIGIN/../lib' "$dest/bin/$name"
    local queue=("$dest/bin/$name") f lib src
    while [[ ${#queue[@]} -gt 0 ]]; do
        f=${queue[0]}; queue=("${queue[@]:1}")
        for lib in $(aarch64-linux-gnu-readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            [[ -e "$dest/lib/$lib" ]] && continue
            src=""
            if [[ -e "$ET_A64/lib/$lib" ]]; then src="$ET_A64/lib/$lib"
            elif [[ -e "$NATIVE/sysroot/usr/lib/aarch64-linux-gnu/$lib" ]]; then src="$NATIVE/sysroot/usr/lib/aarch64-linux-gnu/$lib"
            elif [[ -e "$ROOTFS/usr/lib/aarch64-linux-gnu/$lib" || -e "$ROOTFS/lib/aarch64-linux-gnu/$lib" ]]; then continue
            else die "$name needs $lib, which neither the wheel, the arm64 debs nor the rootfs has"; fi
            cp -L "$src" "$dest/lib/$lib"
            queue+=("$dest/lib/$lib")
        done
    done
    # what is installed, in bytes: the benchmark reads this
    {
        echo "binary $(stat -c %s "$dest/bin/$name") $NATIVE_PREFIX/bin/$name"
        for f in "$dest"/lib/*; do echo "lib $(stat -c %s "$f") $NATIVE_PREFIX/lib/$(basename "$f")"; done
    } > "$dest/MANIFEST"
    say "native: installed $NATIVE_PREFIX in the rootfs: $(awk '{s+=$2} END {printf "%.1f MB", s/1e6}' "$dest/MANIFEST") \
(binary $(awk '$1=="binary"{printf "%.1f MB", $2/1e6}' "$dest/MANIFEST"), $(ls "$dest/lib" | wc -l) libraries)"
}

native_prereqs() {
    step_host_packages
    ensure_binfmt
    step_rootfs
    write_cpu_identity
    step_cross_packages
    step_et_aarch64
    step_arm64_debs
}

# A toolchain check that does not need clients/native: scripts/pi-native/et_smoke.cpp links the aarch64
# ExecuTorch runtime and lists a .pte's methods, run under qemu with no Python at all.
cmd_check_native() {
    native_prereqs
    local t0; t0=$(now) pte=${1:-}
    say "check-native: cross-compile scripts/pi-native (et-smoke)"
    cross_build "$ROOT/scripts/pi-native" "$NATIVE/build-smoke" et-smoke || die "the toolchain check did not build"
    done_in build_smoke "$t0"
    if [[ -z "$pte" ]]; then
        pte="$NATIVE/smoke-mlp.pte"
        if [[ ! -f "$pte" ]]; then
            say "check-native: exporting a zoo MLP for executorch on the host (fedge export)"
            local tmp; tmp=$(mktemp -d)
            ( cd "$ROOT" && "$HOST_PY" -m coordinator.cli export --model mlp --input 64 --runtime executorch \
                --cache "$tmp/cache" --out "$tmp" > "$NATIVE/export.log" 2>&1 ) || die "fedge export failed (log: $NATIVE/export.log)"
            mv "$tmp/mlp.pte" "$pte"; rm -rf "$tmp"
        fi
    fi
    say "check-native: et-smoke $pte under qemu-aarch64 ($CPU)"
    env -i PATH=/usr/bin:/bin QEMU_LD_PREFIX="$ROOTFS" QEMU_CPU="$CPU" \
        qemu-aarch64-static "$NATIVE/build-smoke/et-smoke" "$pte"
}

cmd_build_native() {
    local t0; t0=$(now)
    native_prereqs
    [[ -f "$NATIVE_SRC/CMakeLists.txt" ]] || die "no $NATIVE_SRC/CMakeLists.txt"
    local t1; t1=$(now)
    say "build-native: cross-compile $NATIVE_SRC for aarch64 (log: $NATIVE/build.*.log)"
    cross_build "$NATIVE_SRC" "$NATIVE/build" fedge-native || die "clients/native did not cross-compile"
    done_in build_native "$t1"
    install_native "$NATIVE/build/fedge-native"
    done_in setup_native "$t0"
}

# Runs the installed fedge-native in the emulated Pi: a clean environment (no PYTHONPATH, nothing of the
# host's), the rootfs as the loader's prefix, and nothing but $NATIVE_PREFIX beside the base system.
cmd_native() {
    local bin="$ROOTFS$NATIVE_PREFIX/bin/fedge-native"
    [[ -x "$bin" ]] || die "fedge-native is not installed: run $0 build-native first"
    [[ "$(cat "$ROOTFS/.fedge-cpu" 2>/dev/null)" == "$CPU $NCPUS" ]] || write_cpu_identity
    cd "$ROOT"
    exec env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 QEMU_LD_PREFIX="$ROOTFS" QEMU_CPU="$CPU" \
        qemu-aarch64-static "$bin" "$@"
}

cmd_setup() {
    local t0; t0=$(now)
    step_host_packages
    ensure_binfmt
    step_rootfs
    step_wheels
    step_site
    write_cpu_identity
    say "check: python3 in the emulated Pi ($CPU)"
    ( cmd_run python3 -c "import platform, numpy, msgpack, paho.mqtt; print('aarch64 userland ok:', platform.machine(), \
'python', platform.python_version(), 'numpy', numpy.__version__)" ) \
        || die "python3 does not start in the emulated Pi ($CPU): see the lines above"
    done_in setup "$t0"
}

# Runs "$@" in the emulated Pi: a leading python/python3 becomes the rootfs's python3.11. cwd and files are
# the host's (the checkout, runs/); the loopback network is shared, so a host broker is at 127.0.0.1.
cmd_run() {
    [[ $# -gt 0 ]] || die "run: give a command, e.g. run python3 -m firmware_tests --runtime executorch"
    [[ -f "$ROOTFS/.fedge-ready" && -d "$SITE" ]] || die "not set up: run $0 setup first"
    ensure_binfmt
    # rewritten only when the CPU changes: device agents started one after another share these files
    [[ "$(cat "$ROOTFS/.fedge-cpu" 2>/dev/null)" == "$CPU $NCPUS" ]] || write_cpu_identity
    case "$1" in python|python3|python3.11) shift; set -- "$ROOTFS/usr/bin/python3.11" "$@" ;; esac
    cd "$ROOT"
    # exec, so a signal to this script (SIGTERM to stop a device agent) reaches the emulated process
    exec env QEMU_LD_PREFIX="$ROOTFS" QEMU_CPU="$CPU" PYTHONPATH="$ROOT:$SITE" PYTHONNOUSERSITE=1 "$@"
}

cmd_info() {
    echo "checkout  $ROOT"
    echo "pi dir    $PI_DIR"
    echo "cpu       $CPU x $NCPUS"
    echo "host py   $HOST_PY"
    for d in "$ROOTFS" "$WHEELS" "$SITE" "$NATIVE"; do [[ -d "$d" ]] && du -sh "$d"; done
    [[ -f "$ROOTFS$NATIVE_PREFIX/MANIFEST" ]] && echo "native    $NATIVE_PREFIX: $(awk '{s+=$2} END {print s}' \
        "$ROOTFS$NATIVE_PREFIX/MANIFEST") bytes"
    return 0
}

case "${1:-}" in
    setup) shift; cmd_setup "$@" ;;
    run) shift; [[ "${1:-}" == "--" ]] && shift; cmd_run "$@" ;;
    info) cmd_info ;;
    binfmt) ensure_binfmt ;;
    check-native) shift; cmd_check_native "$@" ;;
    build-native|setup-native) cmd_build_native ;;
    native) shift; cmd_native "$@" ;;
    "") sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
    *) bad "unknown command '$1' (setup, run, info, binfmt, check-native, build-native, native; none: help)" ;;
esac
