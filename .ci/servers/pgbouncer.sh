#!/usr/bin/env bash
# PgBouncer for the tests: transaction pooling on 127.0.0.1:6432 in front of the PostgreSQL
# server on 127.0.0.1:5432, database "test", any user trusted.
#
#   .ci/servers/pgbouncer.sh start   # idempotent: installs pgbouncer if needed, waits until it answers
#   .ci/servers/pgbouncer.sh stop    # stops it and removes its config, log and pid
#
# Started by this script, not by the system's service manager: its config, pid and log live in
# one temp dir (path kept in $STATE). PgBouncer refuses to run as root, so as root it runs as
# the postgres user. The pool is small on purpose (8 server connections), so that the tests can
# show more callers than the pooler has connections.
set -euo pipefail

PORT=6432
STATE=${TMPDIR:-/tmp}/twiceshy-pgbouncer.dir
POOL_SIZE=8

answers() { pg_isready -h 127.0.0.1 -p "$PORT" -d test -q 2>/dev/null; }

wait_until() {  # wait_until WHAT COMMAND...: up to 60 s
    local what=$1; shift
    for _ in $(seq 1 120); do
        if "$@"; then return 0; fi
        sleep 0.5
    done
    echo "pgbouncer: $what did not happen within 60 s" >&2
    return 1
}

start() {
    if ! command -v pgbouncer >/dev/null; then
        apt-get install -y pgbouncer >/dev/null
    fi
    if [ -f "$STATE" ] && [ -f "$(cat "$STATE")/pgbouncer.pid" ] \
        && kill -0 "$(cat "$(cat "$STATE")/pgbouncer.pid")" 2>/dev/null; then
        wait_until "PgBouncer answering" answers
        echo "pgbouncer: running on 127.0.0.1:$PORT ($(cat "$STATE"))"
        return 0
    fi
    if answers; then
        echo "pgbouncer: port $PORT is taken by a server this script did not start" >&2
        return 1
    fi
    local dir user
    dir=$(mktemp -d "${TMPDIR:-/tmp}/twiceshy-pgbouncer.XXXXXX")
    echo "$dir" > "$STATE"
    user=$(id -un)
    cat > "$dir/userlist.txt" <<USERS
"postgres" ""
USERS
    cat > "$dir/pgbouncer.ini" <<CONF
[databases]
test = host=127.0.0.1 port=5432 dbname=test

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PORT
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
default_pool_size = $POOL_SIZE
max_db_connections = $POOL_SIZE
max_client_conn = 2000
pidfile = $dir/pgbouncer.pid
logfile = $dir/pgbouncer.log
admin_users = postgres
CONF
    local as=()
    if [ "$user" = root ]; then
        chown -R postgres "$dir"
        as=(-u postgres)
    fi
    pgbouncer -d "${as[@]}" "$dir/pgbouncer.ini"
    wait_until "PgBouncer answering on 127.0.0.1:$PORT" answers
    echo "pgbouncer: running on 127.0.0.1:$PORT ($dir)"
}

stop() {
    if [ -f "$STATE" ]; then
        local dir pid
        dir=$(cat "$STATE")
        if [ -f "$dir/pgbouncer.pid" ]; then
            pid=$(cat "$dir/pgbouncer.pid")
            kill -INT "$pid" 2>/dev/null || true
            wait_until "PgBouncer stopping" sh -c "! kill -0 $pid 2>/dev/null"
        fi
        rm -rf -- "$dir"
        rm -f -- "$STATE"
    fi
    echo "pgbouncer: stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
