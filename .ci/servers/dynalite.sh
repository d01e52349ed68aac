#!/usr/bin/env bash
# dynalite, a DynamoDB-protocol server, in memory on 127.0.0.1:4567, for the DynamoDB store's
# tests (tests/servers.py, TWICESHY_TEST_DYNAMODB).
#
#     .ci/servers/dynalite.sh start    install it (npm) if needed, start it, wait until it answers
#     .ci/servers/dynalite.sh stop     stop the one this script started
#     .ci/servers/dynalite.sh install  only install it (faults/campaign.py runs its own)
#
# Both are idempotent. The package is installed under /tmp (never in the work tree), so a clean
# clone needs nothing but Node.js and npm; the server keeps nothing on disk.
#
# dynalite 4.0.0's own cli.js exits when a client resets its connection mid-request (its request
# handler rethrows the ECONNRESET), which would end the server at a test's first killed client.
# So it is not started with cli.js but with dynalite-server.js beside this script, which makes
# the same server through dynalite's module API and closes a reset exchange instead of dying
# (tests/test_dynalite_server.py resets connections and checks the server still answers).
set -euo pipefail

VERSION=4.0.0
HOST=127.0.0.1
PORT=4567
HOME_DIR=${TWICESHY_DYNALITE_HOME:-/tmp/twiceshy-dynalite-$VERSION}
PID_FILE=$HOME_DIR/dynalite.pid
LOG_FILE=$HOME_DIR/dynalite.log
MODULE=$HOME_DIR/node_modules/dynalite
LAUNCHER=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/dynalite-server.js

answers() {  # a DynamoDB answer (any: it asks for a signature) from 127.0.0.1:4567
    node -e '
        const req = require("http").request(
            { host: process.argv[1], port: +process.argv[2], method: "POST", path: "/",
              headers: { "X-Amz-Target": "DynamoDB_20120810.ListTables",
                         "Content-Type": "application/x-amz-json-1.0" }, timeout: 1000 },
            (res) => { let body = ""; res.on("data", (d) => (body += d));
                       res.on("end", () => process.exit(body.includes("__type") ? 0 : 1)); });
        req.on("error", () => process.exit(1));
        req.on("timeout", () => { req.destroy(); process.exit(1); });
        req.end("{}");
    ' "$HOST" "$PORT" 2>/dev/null
}

ours() {  # the pid in the pid file, if that process is still our dynalite
    [[ -f $PID_FILE ]] || return 1
    local pid
    pid=$(cat "$PID_FILE")
    [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q "$LAUNCHER" || return 1
    echo "$pid"
}

install() {
    if [[ ! -f $MODULE/index.js ]]; then
        echo "dynalite: installing dynalite@$VERSION under $HOME_DIR"
        mkdir -p "$HOME_DIR"
        npm install --prefix "$HOME_DIR" --no-audit --no-fund --no-save --loglevel=error \
            "dynalite@$VERSION" >/dev/null
    fi
}

start() {
    if answers; then
        echo "dynalite: already answering on $HOST:$PORT"
        return 0
    fi
    install
    echo "dynalite: starting on $HOST:$PORT (in memory)"
    nohup node "$LAUNCHER" "$MODULE" "$HOST" "$PORT" >"$LOG_FILE" 2>&1 &
    echo $! >"$PID_FILE"
    for _ in $(seq 1 120); do  # up to 60 s
        if answers; then
            echo "dynalite: answering"
            return 0
        fi
        if ! ours >/dev/null; then
            echo "dynalite: exited; its log:" >&2
            cat "$LOG_FILE" >&2 || true
            return 1
        fi
        sleep 0.5
    done
    echo "dynalite: did not answer within 60 s" >&2
    return 1
}

stop() {
    local pid
    if ! pid=$(ours); then
        rm -f "$PID_FILE"
        echo "dynalite: not running (started by this script)"
        return 0
    fi
    kill "$pid"
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    rm -f "$PID_FILE"
    echo "dynalite: stopped"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    install) install ;;
    *)
        echo "usage: $0 start|stop|install" >&2
        exit 2
        ;;
esac
