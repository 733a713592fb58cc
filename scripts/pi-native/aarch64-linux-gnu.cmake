# CMake toolchain for a Raspberry Pi (arm64 Debian bookworm / Raspberry Pi OS 64-bit) from an x86_64 Debian host,
# with Debian's cross compiler (apt-get install g++-aarch64-linux-gnu). scripts/emulated_pi.sh build-native uses it:
#
#   cmake -S clients/native -B BUILD --toolchain scripts/pi-native/aarch64-linux-gnu.cmake \
#         -DCMAKE_PREFIX_PATH=<aarch64 executorch wheel, unpacked>/executorch
#
# with the environment variable FEDGE_ARM64_SYSROOT naming a directory where the arm64 .debs of the C
# libraries were unpacked (dpkg -x libmosquitto-dev_*_arm64.deb libmosquitto1_*_arm64.deb), and optionally
# FEDGE_ARM64_RUNTIME_ROOT naming an arm64 userland (for the libraries those depend on: libssl3, ...).
# Environment variables rather than cache variables because CMake re-reads this file for every try_compile,
# where only the environment survives.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

if(NOT DEFINED ENV{FEDGE_ARM64_SYSROOT})
  message(FATAL_ERROR "set FEDGE_ARM64_SYSROOT to the directory holding the unpacked arm64 .debs")
endif()
set(_fedge_sysroot "$ENV{FEDGE_ARM64_SYSROOT}")
set(_fedge_rt "$ENV{FEDGE_ARM64_RUNTIME_ROOT}")

# Libraries and headers come from the arm64 sysroot only (never the host's x86_64 ones); programs from the
# host. Packages from both: the CMAKE_PREFIX_PATH (the aarch64 wheel) and the host's header-only msgpack-cxx
# and nlohmann_json configs, which are the same for every architecture.
set(CMAKE_FIND_ROOT_PATH "${_fedge_sysroot}")
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# pkg-config (libmosquitto) reads the arm64 .pc files and prefixes their paths with the sysroot
set(ENV{PKG_CONFIG_LIBDIR} "${_fedge_sysroot}/usr/lib/aarch64-linux-gnu/pkgconfig:${_fedge_sysroot}/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_SYSROOT_DIR} "${_fedge_sysroot}")
set(ENV{PKG_CONFIG_PATH} "")

# the linker resolves the arm64 libraries' own dependencies (libmosquitto -> libssl3) in the same places
set(_fedge_rpath_link "${_fedge_sysroot}/usr/lib/aarch64-linux-gnu")
if(_fedge_rt)
  string(APPEND _fedge_rpath_link ":${_fedge_rt}/usr/lib/aarch64-linux-gnu:${_fedge_rt}/lib/aarch64-linux-gnu")
endif()
set(CMAKE_EXE_LINKER_FLAGS_INIT "-Wl,-rpath-link,${_fedge_rpath_link}")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "-Wl,-rpath-link,${_fedge_rpath_link}")
