#!/bin/sh
# Writes docker/.env for docker/compose.yaml: a random PostgreSQL password and the matching
# EDGE_UN_DATABASE_URL, readable by its owner only. Never overwrites an existing one.
set -eu
env_file="$(dirname "$0")/.env"
if [ -e "$env_file" ]; then
    echo "$env_file exists: left as it is" >&2
    exit 1
fi
# hex: nothing in it needs escaping in the URL
password=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')
umask 077
cat >"$env_file" <<END
POSTGRES_PASSWORD=$password
EDGE_UN_DATABASE_URL=postgresql+psycopg://edge_un:$password@postgres:5432/edge_un
END
echo "wrote $env_file"
