#!/usr/bin/env bash
# System libraries the Python stack needs at run time on a fresh Debian/Ubuntu machine:
# libibverbs1 is loaded by the Mooncake wheel (our comparison baseline and the mooncake reference
# tests), even when it only uses TCP. Installs only what is missing; needs root and apt-get.
set -u
missing=()
ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1' || missing+=(libibverbs1)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "warning: missing system packages ${missing[*]} (install them as root); the Mooncake comparison will not load" >&2
  exit 0
fi
echo "installing system packages: ${missing[*]}"
apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
