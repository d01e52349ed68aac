#!/usr/bin/env bash
# A Redis Cluster for the tests: three masters and three replicas on 127.0.0.1:7101-7106.
#
#   .ci/servers/redis-cluster.sh start   # idempotent: starts what is missing, waits for ok
#   .ci/servers/redis-cluster.sh stop    # shuts every node down and removes its data
#
# No persistence (no RDB, no AOF); each node's config, nodes.conf and log live in one temp dir,
# whose path is kept in $STATE. A node started from its config file (redis-server FILE) can be
# started again the same way after a test killed it: it rejoins as a replica (INFO server shows
# the executable and config_file). cluster-node-timeout is 2 s, so a killed master is replaced
# in about three seconds.
set -euo pipefail

PORTS=(7101 7102 7103 7104 7105 7106)
STATE=${TMPDIR:-/tmp}/twiceshy-redis-cluster.dir
NODE_TIMEOUT_MS=2000

answers() { redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null | grep -q PONG; }
cluster_ok() { redis-cli -h 127.0.0.1 -p "$1" cluster info 2>/dev/null | grep -q '^cluster_state:ok'; }

wait_until() {  # wait_until WHAT COMMAND...: up to 60 s
    local what=$1; shift
    for _ in $(seq 1 120); do
        if "$@"; then return 0; fi
        sleep 0.5
    done
    echo "redis-cluster: $what did not happen within 60 s" >&2
    return 1
}

all_ok() {
    local port
    for port in "${PORTS[@]}"; do cluster_ok "$port" || return 1; done
    # Every master has its replica again (a node restarted after a kill rejoins as one).
    [ "$(redis-cli -h 127.0.0.1 -p "${PORTS[0]}" cluster nodes | grep -c 'slave\|replica')" -ge 3 ]
}

start_node() {
    local port=$1 dir=$2/$1
    mkdir -p "$dir"
    if [ ! -f "$dir/redis.conf" ]; then
        cat > "$dir/redis.conf" <<CONF
bind 127.0.0.1
port $port
daemonize yes
dir $dir
pidfile $dir/redis.pid
logfile $dir/redis.log
save ""
appendonly no
cluster-enabled yes
cluster-config-file $dir/nodes.conf
cluster-node-timeout $NODE_TIMEOUT_MS
maxmemory-policy noeviction
CONF
    fi
    # By its absolute path: INFO server's executable (how a test starts a node again) is argv[0].
    "$(command -v redis-server)" "$dir/redis.conf"
}

start() {
    command -v redis-server >/dev/null || { apt-get install -y redis-server >/dev/null; }
    local dir
    if [ -f "$STATE" ] && [ -d "$(cat "$STATE")" ]; then
        dir=$(cat "$STATE")
    else
        for port in "${PORTS[@]}"; do
            if answers "$port"; then
                echo "redis-cluster: port $port is taken by a server this script did not start" >&2
                return 1
            fi
        done
        dir=$(mktemp -d "${TMPDIR:-/tmp}/twiceshy-redis-cluster.XXXXXX")
        echo "$dir" > "$STATE"
    fi
    local port fresh=0
    for port in "${PORTS[@]}"; do
        if ! answers "$port"; then
            [ -f "$dir/$port/nodes.conf" ] || fresh=1
            start_node "$port" "$dir"
        fi
    done
    for port in "${PORTS[@]}"; do wait_until "node $port answering" answers "$port"; done
    if [ "$fresh" = 1 ] && ! cluster_ok "${PORTS[0]}"; then
        local seeds=()
        for port in "${PORTS[@]}"; do seeds+=("127.0.0.1:$port"); done
        redis-cli --cluster create "${seeds[@]}" --cluster-replicas 1 --cluster-yes >/dev/null
    fi
    wait_until "cluster_state:ok on every node" all_ok
    echo "redis-cluster: ok on 127.0.0.1:${PORTS[0]}-${PORTS[-1]} ($dir)"
}

stop() {
    local port
    for port in "${PORTS[@]}"; do
        if answers "$port"; then redis-cli -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 || true; fi
    done
    for port in "${PORTS[@]}"; do wait_until "node $port stopping" sh -c "! redis-cli -h 127.0.0.1 -p $port ping >/dev/null 2>&1"; done
    if [ -f "$STATE" ]; then
        rm -rf -- "$(cat "$STATE")"
        rm -f -- "$STATE"
    fi
    echo "redis-cluster: stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
