# Shared by deploy/test-compose.sh and deploy/test-two-hosts.sh (sourced, not run): the compose
# command, a free port, the host binary, and the cleanup of a test project. The caller sets `files`
# (compose -f arguments), `profile` (may be empty), `work`, `LAYERSTREAM_IMAGE`, COMPOSE_PROJECT_NAME.
compose() { if docker compose version >/dev/null 2>&1; then docker compose "$@"; else docker-compose "$@"; fi; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# The host's layerstream (LAYERSTREAM_BUILD_PROFILE=dev: the debug build CI's tests just made).
if [ "${LAYERSTREAM_BUILD_PROFILE:-release}" = dev ]; then bin=target/debug/layerstream; else bin=target/release/layerstream; fi

project() { compose "${files[@]}" ${profile:+--profile "$profile"} "$@"; }

# Removes the project's containers, volumes and image and the work directory (run on EXIT).
cleanup() {
    project down -v --remove-orphans >/dev/null 2>&1 || true
    docker image rm -f "$LAYERSTREAM_IMAGE" >/dev/null 2>&1 || true
    rm -rf "$work"
}

# Takes the project down and fails if any of its containers or volumes is left.
down_and_check() {
    project down -v --remove-orphans >/dev/null 2>&1
    local c v
    c=$(docker ps -a --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" -q | wc -l)
    v=$(docker volume ls --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" -q | wc -l)
    [ "$c" = 0 ] && [ "$v" = 0 ] || { echo "left behind: $c containers, $v volumes"; exit 1; }
}

# Waits (3 min at most) until the coordinator at $1 answers health checks; shows the logs if not.
wait_healthy() {
    for i in $(seq 1 180); do
        $bin health --addr "$1" >/dev/null 2>&1 && return 0
        sleep 1
    done
    project logs --tail 30
    echo "coordinator never became healthy"
    exit 1
}
