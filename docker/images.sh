#!/usr/bin/env bash
# Build the specdec container images with a Docker engine, or with buildah where there is
# none (no registry, no package index: a debootstrap base and wheels from the host).
#   docker/images.sh base             local Python base image (debootstrap) in buildah storage
#   docker/images.sh wheels           fill docker/wheels/ for offline builds (host pip)
#   docker/images.sh build ROLE...    build specdec-ROLE images (drafter, verifier, gateway)
#   docker/images.sh size ROLE...     print each image's size
#   docker/images.sh name ROLE...     print each image's reference (what the chart defaults to)
# Settings (environment): BUILDER (auto|docker|buildah), IMAGE_PREFIX, IMAGE_TAG, BASE_IMAGE,
# TORCH_VARIANT, PYTHON (the host Python whose pip fills docker/wheels/), BUILDAH_ROOT.
# Names: IMAGE_PREFIX-gateway:IMAGE_TAG, IMAGE_PREFIX-drafter:IMAGE_TAG-TORCH_VARIANT (and the
# verifier's alike), the scheme the Helm chart's images.prefix / images.tag /
# <role>.image.torchVariant follow; IMAGE_TAG defaults to the chart's appVersion and
# TORCH_VARIANT to cu128, so the defaults build what `helm install` pulls by default.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE_PREFIX=${IMAGE_PREFIX:-localhost/specdec}
IMAGE_TAG=${IMAGE_TAG:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' helm/specdec/Chart.yaml)}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TORCH_VARIANT=${TORCH_VARIANT:-cu128}
PYTHON=${PYTHON:-.venv/bin/python}
BUILDAH_ROOT=${BUILDAH_ROOT:-$PWD/build/containers}
LOCAL_BASE=localhost/specdec-python:3.11-bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

die() { echo "images: $*" >&2; exit 1; }

buildah_() {
    buildah --root "$BUILDAH_ROOT/storage" --runroot "$BUILDAH_ROOT/run" --storage-driver vfs "$@"
}

builder() {
    case ${BUILDER:-auto} in
    docker | buildah) echo "$BUILDER" ;;
    auto)
        if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
            echo docker
        elif command -v buildah >/dev/null; then
            echo buildah
        else
            die "no Docker engine (\`docker info\` fails) and no buildah: install Docker, or" \
                "\`apt-get install -y buildah debootstrap\` to build without one"
        fi
        ;;
    *) die "BUILDER must be auto, docker or buildah (got '$BUILDER')" ;;
    esac
}

need() {
    command -v "$1" >/dev/null || die "$1 is not installed ($2)"
}

# Debian bookworm minbase + python3 + python3-venv, imported into buildah's storage.
base() {
    need debootstrap "apt-get install -y debootstrap"
    need buildah "apt-get install -y buildah"
    local rootfs=build/base-rootfs start=$SECONDS
    if [ ! -x "$rootfs/usr/bin/python3" ]; then
        rm -rf "$rootfs"
        debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" \
            "$DEBIAN_MIRROR"
    fi
    local ctr mnt
    ctr=$(buildah_ from scratch)
    mnt=$(buildah_ mount "$ctr")
    tar -C "$rootfs" --exclude='./var/cache/apt/archives/*.deb' \
        --exclude='./var/lib/apt/lists/*' --exclude='./usr/share/doc/*' \
        --exclude='./usr/share/man/*' --exclude='./usr/share/locale/*' -cf - . |
        tar -C "$mnt" -xf -
    buildah_ config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --env LANG=C.UTF-8 --cmd '["python3"]' "$ctr"
    buildah_ umount "$ctr" >/dev/null
    buildah_ commit --quiet --rm "$ctr" "$LOCAL_BASE" >/dev/null
    ctr=$(buildah_ from --quiet "$LOCAL_BASE")
    local version
    version=$(buildah_ run --isolation chroot "$ctr" python3 --version)
    buildah_ rm "$ctr" >/dev/null
    echo "images: base image $LOCAL_BASE ($version) in $((SECONDS - start)) s"
}

# Every wheel the three images need, for the Python of the local base image (3.11.x).
wheels() {
    [ -x "$PYTHON" ] || die "$PYTHON not found: run \`make install\` first"
    local target host start=$SECONDS
    target=${IMAGE_PYTHON:-$(image_python)}
    host=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$host" = "${target%.*}" ] ||
        die "$PYTHON is Python $host, the image runs $target: its wheels would not fit"
    "$PYTHON" docker/fill_wheels.py docker/wheels "$target" \
        "setuptools>=77" "grpcio-tools==1.85.1" "torch==$TORCH_VERSION+$TORCH_VARIANT" ./sdk \
        ./services/common ./services/gateway ./services/replica ./services/drafter ./services/verifier
    touch docker/wheels/.filled
    echo "images: docker/wheels/ holds $(find docker/wheels -name '*.whl' | wc -l) wheels" \
        "($(du -sh docker/wheels | cut -f1)) for Python $target, in $((SECONDS - start)) s"
}

# The full Python version of the local base image (markers such as python_full_version).
image_python() {
    buildah_ inspect --type image "$LOCAL_BASE" >/dev/null 2>&1 ||
        die "no $LOCAL_BASE yet: run \`make base-image\` (or set IMAGE_PYTHON=3.11.N)"
    local ctr version
    ctr=$(buildah_ from --quiet "$LOCAL_BASE")
    version=$(buildah_ run --isolation chroot "$ctr" python3 -c \
        'import platform; print(platform.python_version())') || {
        buildah_ rm "$ctr" >/dev/null
        die "cannot run python3 in $LOCAL_BASE"
    }
    buildah_ rm "$ctr" >/dev/null
    echo "$version"
}

build() {
    [ $# -gt 0 ] || die "build: name at least one of drafter, verifier, gateway"
    local b role
    b=$(builder)
    for role in "$@"; do
        [ -f "services/$role/Dockerfile" ] || die "no services/$role/Dockerfile"
    done
    if [ "$b" = buildah ]; then
        buildah_ inspect --type image "$LOCAL_BASE" >/dev/null 2>&1 || base
        # (re)fill docker/wheels/ when the dependencies changed since it was filled, or it
        # lacks this TORCH_VARIANT's torch
        local stamp=docker/wheels/.filled
        local newer=0 project
        for project in sdk/pyproject.toml services/*/pyproject.toml; do
            [ "$project" -nt "$stamp" ] && newer=1
        done
        if [ ! -f "$stamp" ] || [ "$newer" = 1 ] ||
            ! compgen -G "docker/wheels/torch-$TORCH_VERSION+$TORCH_VARIANT-*.whl" >/dev/null; then
            wheels
        fi
    fi
    for role in "$@"; do
        local tag start=$SECONDS
        tag=$(name "$role")
        local args=(--file "services/$role/Dockerfile" --tag "$tag")
        [ "$role" = gateway ] || args+=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT")
        if [ "$b" = docker ]; then
            [ -z "${BASE_IMAGE:-}" ] || args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
            DOCKER_BUILDKIT=1 docker build "${args[@]}" .
        else
            buildah_ bud --isolation chroot --format docker --layers \
                --build-arg "BASE_IMAGE=${BASE_IMAGE:-$LOCAL_BASE}" --build-arg OFFLINE=1 \
                "${args[@]}" .
        fi
        echo "images: built $tag with $b in $((SECONDS - start)) s, $(size_of "$b" "$tag")"
    done
}

# The image's size as its builder reports it (uncompressed, all layers).
size_of() {
    if [ "$1" = docker ]; then
        docker image ls --format '{{.Size}}' "$2"
    else
        buildah_ images --noheading --format '{{.Size}}' "$2"
    fi
}

size() {
    local b role
    b=$(builder)
    for role in "$@"; do
        echo "$(name "$role") $(size_of "$b" "$(name "$role")")"
    done
}

# The reference of a role's image: the model replicas' tags name their torch build.
name() {
    [ $# -gt 0 ] || die "name: name at least one of drafter, verifier, gateway"
    local role
    for role in "$@"; do
        case $role in
        gateway) echo "$IMAGE_PREFIX-$role:$IMAGE_TAG" ;;
        drafter | verifier) echo "$IMAGE_PREFIX-$role:$IMAGE_TAG-$TORCH_VARIANT" ;;
        *) die "no image for role '$role' (drafter, verifier, gateway)" ;;
        esac
    done
}

cmd=${1:-}
shift || true
case $cmd in
base | wheels | build | size | name) "$cmd" "$@" ;;
*) die "usage: docker/images.sh base | wheels | build ROLE... | size ROLE... | name ROLE..." ;;
esac
