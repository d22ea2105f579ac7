#!/bin/sh
# The image's `edge-un` (first on PATH, and the ENTRYPOINT): runs /opt/edge-un/bin/edge-un as
# the user who owns the directory it writes, so that `docker run -v "$PWD:/data" edge-un ...`
# works for whoever runs it and leaves files that user owns.
#
# Started as root (the image's default user), it takes the owner uid/gid of
#   - $EDGE_UN_DATA_DIR for serve, worker and token (the volume: uid 1000 unless mounted from
#     the host); when that is root's, or does not exist yet, the image's user edge-un (uid
#     1000; a new directory is made for it): the network-facing service never runs as root;
#   - the working directory otherwise (/data, where docs/service/docker.md's commands mount yours);
# and drops to it with setpriv (no supplementary groups), as database images do. For a
# one-off command a root-owned directory keeps root: only root may write there (and with
# rootless Docker or podman that root is the host user). Started with --user (not root), it
# just runs.
# Either way the process gets a HOME it can write (caches: torch, matplotlib, Hugging Face,
# ONNX Runtime), whatever its uid, and USER/LOGNAME when the uid has no passwd entry.
set -eu
# `docker run ... edge-un sh` (or bash, python, an absolute path) runs that instead, as the
# same user: a shell or an interpreter in the environment the commands get
case ${1-} in
sh | bash | python | python3 | /*) ;;
*) set -- /opt/edge-un/bin/edge-un "$@" ;;
esac

# owner of a directory, or of its nearest existing parent: "uid gid"
owner_of() {
    dir=$1
    while [ ! -e "$dir" ]; do dir=$(dirname "$dir"); done
    stat -c '%u %g' "$dir"
}

# a HOME for uid $1 (gid $2), created when needed: passwd's if that uid owns it (root,
# edge-un), else /tmp/edge-un-home-UID, made by and for that uid
home_for() {
    home=$(getent passwd "$1" | cut -d: -f6) || home=
    if [ -n "$home" ] && [ -d "$home" ] && [ "$(stat -c %u "$home")" = "$1" ]; then
        echo "$home"
        return
    fi
    home=/tmp/edge-un-home-$1
    if [ "$(id -u)" = 0 ]; then
        mkdir -p -m 700 "$home" && chown "$1:$2" "$home"
    elif ! mkdir -p -m 700 "$home" 2>/dev/null || [ "$(stat -c %u "$home")" != "$1" ]; then
        home=$(mktemp -d /tmp/edge-un-home-XXXXXX)
    fi
    echo "$home"
}

set_user_env() { # uid gid
    HOME=$(home_for "$1" "$2")
    if ! getent passwd "$1" >/dev/null; then
        USER=uid$1 LOGNAME=uid$1   # getpass.getuser() (torch's caches) needs a name
        export USER LOGNAME
    fi
    export HOME
}

# the subcommand: the first argument after the options (`edge-un --debug serve`)
subcommand() {
    shift # the program
    for arg in "$@"; do
        case $arg in
        -*) ;;
        *) echo "$arg" && return ;;
        esac
    done
}

# "uid gid" to run the service as: the data directory's owner, else the image's user
service_ids() {
    data=${EDGE_UN_DATA_DIR:-$PWD}
    if [ -d "$data" ] && [ "$(stat -c %u "$data")" != 0 ]; then
        stat -c '%u %g' "$data"
        return
    fi
    if [ ! -e "$data" ]; then
        mkdir -p "$data" && chown edge-un:edge-un "$data"
    fi
    echo "$(id -u edge-un) $(id -g edge-un)"
}

if [ "$(id -u)" = 0 ]; then
    case $(subcommand "$@") in
    serve | worker | token) ids=$(service_ids) ;;
    *) ids=$(owner_of "$PWD") ;;
    esac
    uid=${ids% *} gid=${ids#* }
    if [ "$uid" != 0 ]; then
        set_user_env "$uid" "$gid"
        exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- "$@"
    fi
    set_user_env 0 0
else
    set_user_env "$(id -u)" "$(id -g)"
fi
exec "$@"
