#!/usr/bin/env bash
# Start a throwaway PostgreSQL for the database tests and print the line that points them at it.
#
#   eval "$(.ci/postgres.sh)"      # -> export TIDAL_TEST_PG_URL=postgresql+psycopg://tidal:...@127.0.0.1:55432/tidal_test
#
# - Installs PostgreSQL from Debian packages only if no server binaries are found.
# - The cluster lives in a throwaway data dir under /tmp, listens on 127.0.0.1 only (no other interface, its
#   unix socket inside the data dir), and runs with fsync off: it holds test data only.
# - Idempotent: a second run finds the cluster initialised and running, and prints the same URL.
# - stdout carries only the export line; progress goes to stderr. The URL is also written to $URL_FILE.
#
# Knobs (env): TIDAL_PG_PORT (55432), TIDAL_PG_DATA (/tmp/tidal-pg-$PORT).
set -euo pipefail

PORT="${TIDAL_PG_PORT:-55432}"
DATA="${TIDAL_PG_DATA:-/tmp/tidal-pg-$PORT}"
URL_FILE="$DATA.url"
DB=tidal_test
ROLE=tidal

log() { echo "postgres.sh: $*" >&2; }

find_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }

BIN="$(find_bin)"
if [ -z "$BIN" ] || [ ! -x "$BIN/pg_ctl" ]; then
  log "PostgreSQL not found; installing it from Debian packages"
  # The package's default cluster may start on 5432; we never use it (our own cluster is below).
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >&2
  BIN="$(find_bin)"
fi

# initdb and postgres refuse to run as root: run them as the `postgres` user when we are root.
if [ "$(id -u)" = 0 ]; then
  as_pg() { runuser -u postgres -- "$@"; }
else
  as_pg() { "$@"; }
fi

if [ ! -s "$DATA/PG_VERSION" ]; then
  log "initialising a cluster in $DATA"
  rm -rf "$DATA" "$URL_FILE"
  mkdir -p "$DATA"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$DATA"
  chmod 700 "$DATA"
  # Socket connections (only reachable inside the 0700 data dir) trust the OS user; TCP needs a password.
  as_pg "$BIN/initdb" -D "$DATA" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
    --encoding=UTF8 --locale=C.UTF-8 >/dev/null
fi

if ! as_pg "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
  log "starting on 127.0.0.1:$PORT"
  opts="-c listen_addresses=127.0.0.1 -p $PORT -k $DATA -c fsync=off -c synchronous_commit=off"
  opts="$opts -c full_page_writes=off -c max_connections=200"
  if ! as_pg "$BIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -o "$opts" -w -t 60 start >/dev/null; then
    log "server failed to start; its log follows"
    tail -n 30 "$DATA/server.log" >&2 || true
    exit 1
  fi
fi

psql_pg() { as_pg "$BIN/psql" -h "$DATA" -p "$PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 -qtAc "$1"; }

if [ ! -s "$URL_FILE" ] || [ -z "$(psql_pg "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" ]; then
  # A fresh random password per cluster: the URL file (mode 0600) is where it is kept.
  PASS="$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
  if [ -z "$(psql_pg "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" ]; then
    psql_pg "CREATE ROLE $ROLE LOGIN PASSWORD '$PASS'"
  else
    psql_pg "ALTER ROLE $ROLE PASSWORD '$PASS'"
  fi
  (umask 077 && echo "postgresql+psycopg://$ROLE:$PASS@127.0.0.1:$PORT/$DB" >"$URL_FILE")
fi
if [ -z "$(psql_pg "SELECT 1 FROM pg_database WHERE datname = '$DB'")" ]; then
  psql_pg "CREATE DATABASE $DB OWNER $ROLE"
fi

echo "export TIDAL_TEST_PG_URL=$(cat "$URL_FILE")"
