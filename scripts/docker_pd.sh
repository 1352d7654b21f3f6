#!/usr/bin/env bash
# PD in Docker, end to end on a CPU machine (docs/pd.md, "PD in Docker"): the images build, `docker compose up`
# starts a prefill node, an ESS decode node, SGLang's router and a co-located stock server (docker/compose.cpu.yaml),
# and greedy tokens through the router's port equal stock's (ess.harness.pd_check). Run as root from anywhere:
#   bash scripts/docker_pd.sh [OUT]        (OUT: where the log goes; default benchmark/results/docker/pd-<date>)
# What it does, each step skipped where already done:
#   1. the Docker engine: Debian's docker.io and docker-compose installed with apt where absent, dockerd started
#      (--iptables=false --bridge=none: the containers use the host's network);
#   2. a base image standing in for SGLang's official one (no registry here): Debian 12 made with debootstrap and
#      imported, then sglang 0.5.23, torch 2.14.1, Mooncake's engine and SGLang's router installed by pip in a
#      container that uses the host's pip settings (its config, CA bundle and the local package folders it names);
#   3. the ESS image on that base (docker/Dockerfile, --build-arg BASE), the tiny checkpoint, compose up, the check.
# Env: BASE (default ess-base:cpu: an image of your own skips step 2), IMAGE (ess-sglang:cpu), KEEP=1 (leave the
# stack running).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$ROOT/benchmark/results/docker/pd-$(date +%F)}")
BASE=${BASE:-ess-base:cpu}
IMAGE=${IMAGE:-ess-sglang:cpu}
ROOTFS_IMAGE=ess-rootfs:bookworm
WORK=${WORK:-/var/tmp/ess-docker}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/run.log"
exec > >(tee "$LOG") 2>&1
say() { echo "docker_pd: $(date -u +%H:%M:%S) $*"; }
say "commit $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'), host $(hostname), $(nproc) cores, log $LOG"
[ "$(id -u)" = 0 ] || { echo "docker_pd: run as root (apt, dockerd, debootstrap)" >&2; exit 2; }

# -- 1. the engine --------------------------------------------------------------------------------------------------
if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing docker.io, docker-compose and debootstrap (apt)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap >"$WORK/apt.log" 2>&1 \
    || { tail -20 "$WORK/apt.log"; exit 1; }
fi
if ! docker info >/dev/null 2>&1; then
  say "starting dockerd (log $WORK/dockerd.log)"
  nohup dockerd --iptables=false --bridge=none >"$WORK/dockerd.log" 2>&1 &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { tail -20 "$WORK/dockerd.log"; exit 1; }
fi
say "engine: $(docker version --format 'server {{.Server.Version}}') ($(docker info --format '{{.Driver}}')), $(docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /')"
if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi

# -- 2. the base image ----------------------------------------------------------------------------------------------
if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  [ "$BASE" = ess-base:cpu ] || { echo "docker_pd: no image $BASE here (pull or load it, or leave BASE unset)" >&2; exit 1; }
  if ! docker image inspect "$ROOTFS_IMAGE" >/dev/null 2>&1; then
    say "debootstrap: Debian 12 (python3.11; libibverbs, libnuma and libcurl for Mooncake's engine) into $WORK/rootfs"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libibverbs1,libnuma1,libcurl4,procps \
      bookworm "$WORK/rootfs" http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    rm -rf "$WORK/rootfs/var/cache/apt/archives/"*.deb
    tar -C "$WORK/rootfs" -c . | docker import - "$ROOTFS_IMAGE" >/dev/null
    rm -rf "$WORK/rootfs"
  fi
  # the host's pip settings, mounted read-only: config files, CA bundle, and the local folders they name
  mounts=(); pipenv=()
  for f in /etc/pip.conf /etc/xdg/pip "$HOME/.config/pip" /etc/ssl/certs/ca-certificates.crt; do
    [ -e "$f" ] && mounts+=(-v "$f:$f:ro")
  done
  for d in $( (python3 -m pip config list 2>/dev/null; env | grep '^PIP_') | grep -oE '(file://)?/[^ '"'"'"]+' \
              | sed -e 's#^file://##' -e 's#/simple/*$##' | sort -u); do  # an index's pages link to ../files
    [ -e "$d" ] && [ "$d" != /etc/ssl/certs/ca-certificates.crt ] && mounts+=(-v "$d:$d:ro")
  done
  for v in $(env | grep -oE '^PIP_[A-Z_]+'); do pipenv+=(-e "$v"); done
  say "base image $BASE: pip installs sglang 0.5.23 and torch 2.14.1 into /opt/venv (a few minutes, about 11 GB)"
  docker rm -f ess-base-build >/dev/null 2>&1 || true
  docker run --name ess-base-build --network host "${mounts[@]}" "${pipenv[@]}" -e PIP_NO_CACHE_DIR=1 \
    -e PIP_DISABLE_PIP_VERSION_CHECK=1 -e PIP_PROGRESS_BAR=off "$ROOTFS_IMAGE" sh -c '
      python3 -m venv /opt/venv && /opt/venv/bin/pip install -q "setuptools>=68" wheel &&
      /opt/venv/bin/pip install -q torch==2.14.1 sglang==0.5.23 sglang-router==0.3.2 \
        mooncake-transfer-engine-non-cuda==0.3.13.post1 safetensors tokenizers rich matplotlib scipy &&
      /opt/venv/bin/python -c "import sglang, torch, mooncake.engine, sglang_router; print(\"base:\", sglang.__version__, torch.__version__)"' \
    >"$WORK/base.log" 2>&1 || { tail -30 "$WORK/base.log"; exit 1; }
  tail -1 "$WORK/base.log"
  docker commit --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    ess-base-build "$BASE" >/dev/null
  docker rm ess-base-build >/dev/null
fi

# -- 3. the ESS image, the checkpoint, the stack, the check ---------------------------------------------------------
say "building $IMAGE on $BASE (docker/Dockerfile)"
docker build --network host --build-arg BASE="$BASE" -f "$ROOT/docker/Dockerfile" -t "$IMAGE" "$ROOT" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
MODEL_DIR="$WORK/model"
rm -rf "$MODEL_DIR"; mkdir -p "$MODEL_DIR"
docker run --rm -v "$MODEL_DIR:/model" "$IMAGE" python3 -c "from ess.reference import checkpoint; checkpoint.write('/model', seed=0)"
say "the tiny checkpoint in $MODEL_DIR; compose up (docker/compose.cpu.yaml)"
export MODEL_DIR ESS_IMAGE="$IMAGE"
compose() { "${COMPOSE[@]}" -p ess-pd -f "$ROOT/docker/compose.cpu.yaml" "$@"; }
down() {
  compose logs --no-color >"$OUT/compose.log" 2>&1 || true
  [ "${KEEP:-0}" = 1 ] || compose down >/dev/null 2>&1 || true
}
trap down EXIT
compose up -d
set +e
docker run --rm --network host "$IMAGE" python3 -m ess.harness.pd_check --stock 30100 --router 30180 --decode 30102 \
  | tee "$OUT/check.json"
rc=${PIPESTATUS[0]}
set -e
compose ps
[ "$rc" = 0 ] && say "PASS: tokens through the router equal stock's" || say "FAIL (exit $rc): see $OUT/compose.log"
exit "$rc"
