# syntax=docker/dockerfile:1.7
# ROCm SGLang image with MORI-IO and the sglang-mori plugin (needs BuildKit: Docker >= 23).
#
#   docker build -f docker/rocm.Dockerfile -t sglang-mori:mi30x-ainic \
#       --build-arg NIC_BACKEND=ainic .                                   # MI300X + Pollara
#   docker build -f docker/rocm.Dockerfile -t sglang-mori:mi35x-cx7 \
#       --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.23-rocm724-mi35x \
#       --build-arg NIC_BACKEND=mlx5 .                                    # MI355X + ConnectX-7
#
# Build arguments:
#   BASE_IMAGE    a ROCm SGLang 0.5.23 image with Python 3.12 (amd-mori 1.2.4 ships cp312 wheels only):
#                 v0.5.23-rocm724-mi30x for MI300X, v0.5.23-rocm724-mi35x for MI355X
#   ENABLE_MORI   1 (default): install amd-mori; 0: plugin only (softio engine, no RDMA)
#   NIC_BACKEND   userspace RDMA provider for the node's NICs:
#                 none (default: rdma-core + ibverbs-utils only), mlx5 (ConnectX: libmlx5),
#                 bnxt (Broadcom Thor2: bnxt-rocelib / libbnxt_re), ainic (AMD Pollara: libionic)
# Kernel drivers (mlx5_ib, bnxt_re, ionic_rdma, amdgpu_peermem) live on the host, not in the image:
# run `sglang-mori doctor` inside the container on each node.
#
# The shell steps are heredocs so that test/unit/test_dockerfile.py can run them with bash in a dry
# run (DOCKER_DRY_RUN=1 prints commands instead of running them); nothing sets it during a build.

ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23-rocm724-mi30x
FROM ${BASE_IMAGE}

ARG ENABLE_MORI=1
ARG NIC_BACKEND=none
ARG MORI_VERSION=1.2.4
ARG SGLANG_VERSION=0.5.23
# AMD AINIC (Pensando) apt repository version; Broadcom publishes one apt suite for its NIC packages.
ARG AINIC_VERSION=1.117.5
ARG BNXT_APT_SUITE=jammy
# Empty: newest bnxt-rocelib in the repository. Pin it to the bnxt_re driver version on your hosts.
ARG BNXT_ROCELIB_VERSION=
ENV DEBIAN_FRONTEND=noninteractive

# 1. Reject unknown argument values before anything is downloaded.
RUN <<'VALIDATE_ARGS'
#!/usr/bin/env bash
set -euo pipefail
case "${NIC_BACKEND}" in
  none|mlx5|bnxt|ainic) ;;
  *) echo "ERROR: unknown NIC_BACKEND='${NIC_BACKEND}'. Use one of: none, mlx5, bnxt, ainic" >&2
     exit 2 ;;
esac
case "${ENABLE_MORI}" in
  0|1) ;;
  *) echo "ERROR: ENABLE_MORI must be 0 or 1, got '${ENABLE_MORI}'" >&2
     exit 2 ;;
esac
echo "build: NIC_BACKEND=${NIC_BACKEND} ENABLE_MORI=${ENABLE_MORI}"
VALIDATE_ARGS

# 2. RDMA userspace: verbs library and tools for every NIC, plus the vendor provider MORI-IO loads.
#    Without the provider, MORI-IO finds no usable device and aborts the process.
RUN <<'NIC_USERSPACE'
#!/usr/bin/env bash
set -euo pipefail
run() { if [ "${DOCKER_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
apt_install() { run apt-get install -y --no-install-recommends "$@"; }
add_apt_repo() {  # name key-url "deb line": a signed third-party apt source
  run mkdir -p /etc/apt/keyrings
  run sh -c "curl -fsSL --retry 5 '$2' | gpg --dearmor --yes -o /etc/apt/keyrings/$1.gpg"
  run sh -c "echo 'deb [arch=amd64 signed-by=/etc/apt/keyrings/$1.gpg] $3' > /etc/apt/sources.list.d/$1.list"
  run apt-get update
}
require_lib() {  # fail the build if the provider did not land where libibverbs looks
  if [ "${DOCKER_DRY_RUN:-0}" = 1 ]; then echo "+ require $1"; return; fi
  if ! ldconfig -p | grep -q "$1" && ! find /usr /opt -name "$1*.so*" -print -quit | grep -q .; then
    echo "ERROR: $1 not found after installing the NIC_BACKEND=${NIC_BACKEND} userspace" >&2
    exit 1
  fi
}
codename="$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")"
run apt-get update
apt_install rdma-core ibverbs-utils libibverbs1 ca-certificates curl gnupg
case "${NIC_BACKEND}" in
  none)
    echo "NIC_BACKEND=none: generic rdma-core only; no vendor provider" ;;
  mlx5)
    apt_install ibverbs-providers
    require_lib libmlx5 ;;
  bnxt)
    add_apt_repo broadcom-nic \
      https://packages.broadcom.com/artifactory/api/security/keypair/PackagesKey/public \
      "https://packages.broadcom.com/artifactory/ethernet-nic-debian-public ${BNXT_APT_SUITE} main"
    apt_install "bnxt-rocelib${BNXT_ROCELIB_VERSION:+=${BNXT_ROCELIB_VERSION}}"
    require_lib libbnxt_re ;;
  ainic)
    add_apt_repo amdainic https://repo.radeon.com/rocm/rocm.gpg.key \
      "https://repo.radeon.com/amdainic/pensando/ubuntu/${AINIC_VERSION} ${codename} main"
    apt_install libionic-dev ionic-common
    require_lib libionic ;;
  *)
    echo "ERROR: unknown NIC_BACKEND='${NIC_BACKEND}'. Use one of: none, mlx5, bnxt, ainic" >&2
    exit 2 ;;
esac
run sh -c 'rm -rf /var/lib/apt/lists/*'
NIC_USERSPACE

# 3. MORI-IO (amd-mori from PyPI; wheels are built for CPython 3.12 on ROCm 7 images).
RUN <<'MORI'
#!/usr/bin/env bash
set -euo pipefail
run() { if [ "${DOCKER_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
if [ "${ENABLE_MORI}" != 1 ]; then
  echo "ENABLE_MORI=${ENABLE_MORI}: amd-mori not installed; set SGLANG_MORI_ENGINE=soft at run time"
  exit 0
fi
run python3 -m pip install --no-cache-dir "amd-mori==${MORI_VERSION}" || {
  echo "ERROR: pip could not install amd-mori==${MORI_VERSION}; its wheels need CPython 3.12" \
       "(python3 here: $(python3 -V 2>&1)). Pick a BASE_IMAGE with Python 3.12 or another MORI_VERSION." >&2
  exit 1
}
# Importing mori.io needs the GPU runtime; the node check is `sglang-mori doctor` at run time.
run python3 -c "import importlib.metadata as m; print('amd-mori', m.version('amd-mori'))"
MORI

# 4. The plugin. Only the package sources are copied (see rocm.Dockerfile.dockerignore).
COPY setup.py /opt/sglang-mori/setup.py
COPY python /opt/sglang-mori/python
RUN <<'PLUGIN'
#!/usr/bin/env bash
set -euo pipefail
run() { if [ "${DOCKER_DRY_RUN:-0}" = 1 ]; then echo "+ $*"; else "$@"; fi; }
# The plugin subclasses SGLang internals and supports one SGLang release exactly.
run python3 -c "import os, sglang, sys; v, want = sglang.__version__, os.environ['SGLANG_VERSION']; sys.exit(None if v == want else f'ERROR: BASE_IMAGE has SGLang {v}; sglang-mori needs {want}')"
run python3 -m pip install --no-cache-dir /opt/sglang-mori
run sglang-mori doctor --help
PLUGIN
