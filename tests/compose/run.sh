#!/usr/bin/env bash
# `make compose-test`: compose.yaml for real, with no image registry and no package index reached from a container.
#
#   1. a Debian 12 base image: debootstrap from a plain-HTTP mirror (DEBIAN_MIRROR), then `docker import`
#   2. the wheelhouse on the host (`make wheelhouse`: ardit's runtime dependencies and CPU torch, cp311 x86_64)
#   3. tests/compose/run_scenario.py: the ardit image from that base and that wheelhouse, built by compose with no
#      network at all; compose up --wait, requests with the openai client, a killed DiT brought back by the restart
#      policy, two replicas of ar and dit, compose down -v
#
# Needs a Docker engine (`tests/compose/run.sh dockerd` starts one as root, as .ci/run does), debootstrap, and the
# project's .venv (compose v2 and the openai client are dev dependencies). Every run starts from nothing: the base
# image is debootstrapped again and the image built with --no-cache (COMPOSE_TEST_REUSE=1 keeps both, for a quicker
# run while editing).
#
#   tests/compose/run.sh dockerd      start dockerd in the background unless one answers; wait for its socket
#   tests/compose/run.sh              steps 1-3
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON_BIN="${PYTHON_BIN:-.venv/bin/python}"
MAKE="${MAKE:-make}"
BASE_IMAGE="${COMPOSE_TEST_BASE_IMAGE:-ardit-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
REUSE="${COMPOSE_TEST_REUSE:-}"
TIMINGS=()

now() { date +%s.%N; }
# phase NAME COMMAND...: runs COMMAND, prints and records its wall time
phase() {
  local name="$1" start end seconds
  shift
  echo "compose-test: == $name"
  start="$(now)"
  "$@"
  end="$(now)"
  seconds="$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')"
  echo "compose-test: == $name: ${seconds} s"
  TIMINGS+=("$name: ${seconds} s")
}

start_dockerd() {
  if docker info >/dev/null 2>&1; then
    echo "compose-test: a Docker engine already answers"
    return
  fi
  [ "$(id -u)" -eq 0 ] || { echo "compose-test: starting dockerd needs root" >&2; exit 1; }
  mkdir -p artifacts
  # Detached from this shell (setsid), so that it outlives the step that started it; its pid is kept for the stop.
  setsid dockerd >artifacts/dockerd.log 2>&1 </dev/null &
  echo $! >artifacts/dockerd.pid
  for _ in $(seq 1 60); do
    if docker info >/dev/null 2>&1; then
      echo "compose-test: dockerd $(docker info --format '{{.ServerVersion}}') is up (storage $(docker info --format '{{.Driver}}'))"
      return
    fi
    sleep 1
  done
  echo "compose-test: dockerd did not answer within 60 s; artifacts/dockerd.log:" >&2
  tail -n 40 artifacts/dockerd.log >&2
  exit 1
}

stop_dockerd() {
  [ -f artifacts/dockerd.pid ] || return 0
  local pid
  pid="$(cat artifacts/dockerd.pid)"
  rm -f artifacts/dockerd.pid
  kill "$pid" 2>/dev/null || return 0
  # dockerd stops its containers and containerd before it exits
  for _ in $(seq 1 30); do
    kill -0 "$pid" 2>/dev/null || { echo "compose-test: dockerd stopped"; return 0; }
    sleep 1
  done
  echo "compose-test: dockerd ($pid) still runs 30 s after SIGTERM" >&2
}

# A minimal Debian 12 with its python3 (3.11, which the wheelhouse is made for) and venv, from a plain-HTTP mirror.
base_image() {
  if [ -n "$REUSE" ] && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    echo "compose-test: reusing $BASE_IMAGE (COMPOSE_TEST_REUSE)"
    return
  fi
  local rootfs on_tmpfs=""
  rootfs="$(mktemp -d /tmp/ardit-rootfs.XXXXXX)"
  # In memory where it may be mounted (root): dpkg syncs every file it writes, and on a busy disk that tripled the
  # time (158 s on disk, 54 s on tmpfs, on this project's 2-core CI machine).
  if mount -t tmpfs -o size=2g,mode=0755 ardit-rootfs "$rootfs" 2>/dev/null; then on_tmpfs=1; fi
  cleanup_rootfs() {
    if [ -n "$on_tmpfs" ]; then umount "$rootfs"; fi
    rm -rf "$rootfs"
  }
  debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$DEBIAN_MIRROR" \
    >artifacts/debootstrap.log 2>&1 || { tail -n 40 artifacts/debootstrap.log >&2; cleanup_rootfs; exit 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import --message "debootstrap bookworm minbase, python3, python3-venv" - "$BASE_IMAGE"
  cleanup_rootfs
}

case "${1:-all}" in
  dockerd) start_dockerd; exit 0 ;;
  stop-dockerd) stop_dockerd; exit 0 ;;
  all) ;;
  *) echo "usage: $0 [dockerd|stop-dockerd]" >&2; exit 2 ;;
esac

command -v docker >/dev/null || { echo "compose-test: no docker client (apt-get install docker.io)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "compose-test: no debootstrap (apt-get install debootstrap)" >&2; exit 1; }
docker info >/dev/null 2>&1 || { echo "compose-test: no Docker engine answers (tests/compose/run.sh dockerd starts one)" >&2; exit 1; }
mkdir -p artifacts
# A project left over from an interrupted run would hold port 8000.
"$PYTHON_BIN" tests/compose/run_scenario.py --down-only

phase "debootstrap + docker import ($BASE_IMAGE)" base_image
phase "wheelhouse (make wheelhouse)" "$MAKE" --no-print-directory wheelhouse
printf '%s\n' "${TIMINGS[@]}" >artifacts/compose-test-timings.txt
export COMPOSE_TEST_BASE_IMAGE="$BASE_IMAGE"
no_cache=(--no-cache)
[ -z "$REUSE" ] || no_cache=()
"$PYTHON_BIN" tests/compose/run_scenario.py --timings-file artifacts/compose-test-timings.txt "${no_cache[@]}"
