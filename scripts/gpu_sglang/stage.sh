#!/usr/bin/env bash
# Copy what a device run needs from this worktree into /work/main/.gpu (ignored there: the device
# tool sends /work/main's tree plus the carried .gpu and .whl). Usage: stage.sh [WORKTREE]
set -euo pipefail
WT=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
DEST=/work/main/.gpu
rm -rf "$DEST" && mkdir -p "$DEST/test"
cp -r "$WT/python" "$WT/scripts" "$DEST/"
cp -r "$WT/test/harness" "$WT/test/gpu" "$WT/test/inprocess" "$DEST/test/"  # test/gpu imports fake_sglang
find "$DEST" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$DEST" /work/main/.whl
