#!/usr/bin/env bash
# Run a command in a private, loopback-only network namespace when this machine allows it, so that
# test servers can never be reached from (or collide with ports on) the host network.
# Falls back to running the command directly, where every test binds 127.0.0.1 anyway.
set -u
if [ "${SGLANG_MORI_IN_NETNS:-}" != "1" ] && command -v unshare >/dev/null 2>&1 \
   && unshare -n true 2>/dev/null; then
  exec unshare -n env SGLANG_MORI_IN_NETNS=1 bash -c 'ip link set lo up 2>/dev/null || true; exec "$@"' _ "$@"
fi
exec "$@"
