#!/bin/sh
# The image's entrypoint. As root it makes the volumes' top folders the share's user's where
# the runtime made them (a missing host folder, a new named volume: root's), then runs itself
# again as PUID:PGID (setpriv: no root left, no supplementary groups, no way back up); as that
# user, with UMASK, it writes the first config, stores the page's password (PASSWORD_FILE,
# FILE__PASSWORD or PASSWORD) as its hash and STEMDECK_HOSTS as api.hosts, fetches the model,
# and replaces itself with the service, which then gets the runtime's SIGTERM directly; the
# password's variables are not passed on to it. With no password set, the page stays on the
# container's loopback (`run --page-local`) and the log says how to set one.
#   (no arguments) | run [OPTIONS]   the service, headless
#   COMMAND [ARGS]                    `stemdeck-watch COMMAND` as the share's user, e.g.
#                                     `models import /models/offline`, `status`, `health`
#   /PATH [ARGS]                      that program as the share's user (a shell, say)
set -eu

CONFIG=/config/stemdeck.toml
VOLUMES="/inbox /outbox /processed /failed /config /models"

fail() {
    echo "stemdeck-watch: $*" >&2
    exit 2
}

if [ -z "${STEMDECK_DROPPED:-}" ]; then
    PUID="${PUID:-1000}"
    PGID="${PGID:-1000}"
    case "$PUID" in '' | *[!0-9]*) fail "PUID must be a number (a user id, e.g. 1000), not '$PUID'" ;; esac
    case "$PGID" in '' | *[!0-9]*) fail "PGID must be a number (a group id, e.g. 1000), not '$PGID'" ;; esac
    if [ "$(id -u)" = 0 ]; then
        for volume in $VOLUMES; do
            mkdir -p "$volume"
            if [ "$(stat -c %u "$volume")" = 0 ] && [ "$PUID" != 0 ]; then
                chown "$PUID:$PGID" "$volume" ||
                    echo "stemdeck-watch: could not give $volume to $PUID:$PGID" >&2
            fi
        done
        export STEMDECK_DROPPED=1
        exec setpriv --reuid="$PUID" --regid="$PGID" --clear-groups --no-new-privs -- "$0" "$@"
    fi
    # started as a user already (`--user`): that user it is
    export STEMDECK_DROPPED=1
fi

UMASK="${UMASK:-022}"
case "$UMASK" in
    [0-7][0-7][0-7] | [0-7][0-7][0-7][0-7]) umask "$UMASK" ;;
    *) fail "UMASK must be octal, e.g. 022 (files rw-r--r--) or 002 (group-writable), not '$UMASK'" ;;
esac
export HOME=/config

case "${1:-run}" in
    /*) exec "$@" ;;
    run) ;;
    *) exec stemdeck-watch --config "$CONFIG" "$@" ;;
esac
[ "$#" -gt 0 ] && shift

# the first config, the password and the model, in a child the runtime's SIGTERM reaches (a
# shell that is process 1 ignores it): an interrupted download resumes at the next start.
# It exits 3 where the page has no password yet: then the page stays on loopback
stopping=""
python3 -m stemdeck_watch.cli.container "$CONFIG" &
child=$!
trap 'stopping=1; kill -TERM "$child" 2>/dev/null || true' TERM INT
status=0
wait "$child" || status=$?
if [ -n "$stopping" ]; then
    wait "$child" || true
    exit 143
fi
trap - TERM INT
unset PASSWORD PASSWORD_FILE FILE__PASSWORD
case "$status" in
    0) exec stemdeck-watch --config "$CONFIG" run --no-tray "$@" ;;
    3) exec stemdeck-watch --config "$CONFIG" run --no-tray --page-local "$@" ;;
    *) exit "$status" ;;
esac
