#!/usr/bin/env bash
# Type-checks grpo for 64-bit ARM Linux (aarch64) on an x86-64 machine: every crate and test,
# with the x86 kernels compiled out and the baseline variants in their place.
#
#   scripts/check_aarch64.sh            # -D warnings: a warning on aarch64 fails it
#
# Needs (installed here when missing): the Rust target `aarch64-unknown-linux-gnu` (rustup) and a
# C cross compiler for the crates that build C code (mimalloc, oniguruma): Debian's
# gcc-aarch64-linux-gnu / g++-aarch64-linux-gnu. Uses target/aarch64-check.
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu ||
  rustup target add aarch64-unknown-linux-gnu
if ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu g++-aarch64-linux-gnu >/dev/null
fi
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++ \
  AR_aarch64_unknown_linux_gnu=aarch64-linux-gnu-ar CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/aarch64-check}" \
  RUSTFLAGS="${RUSTFLAGS:-} -D warnings"
cargo check --target aarch64-unknown-linux-gnu --workspace --all-targets
echo "aarch64 check passed"
