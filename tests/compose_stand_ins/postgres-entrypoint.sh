#!/bin/sh
# Entrypoint of the postgres:16 stand-in (tests/compose_stand_ins/postgres.Dockerfile).
#
# What the official image's entrypoint does for POSTGRES_USER, POSTGRES_PASSWORD and
# POSTGRES_DB: on an empty data directory, initdb with that superuser and password, password
# (scram-sha-256) authentication from any address, listen_addresses '*', and the database; then
# exec the command as the postgres user, so that PostgreSQL is PID 1 and gets the stop signal.
set -eu

: "${PGDATA:=/var/lib/postgresql/data}"
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"

# `docker run IMAGE -c name=value` means `postgres -c name=value`.
if [ "${1#-}" != "$1" ]; then
    set -- postgres "$@"
fi

as_postgres() {
    setpriv --reuid=postgres --regid=postgres --init-groups "$@"
}

if [ "$1" = postgres ] && [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA"
    chmod 0700 "$PGDATA"
    if [ ! -s "$PGDATA/PG_VERSION" ]; then
        if [ -z "${POSTGRES_PASSWORD:-}" ]; then
            echo "postgres stand-in: POSTGRES_PASSWORD is required" >&2
            exit 1
        fi
        pwfile=$(mktemp)
        printf '%s\n' "$POSTGRES_PASSWORD" >"$pwfile"
        chown postgres "$pwfile"
        as_postgres initdb --username="$POSTGRES_USER" --pwfile="$pwfile" \
            --auth-local=trust --auth-host=scram-sha-256 -D "$PGDATA" >/dev/null
        rm -f "$pwfile"
        echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
        echo "listen_addresses = '*'" >>"$PGDATA/postgresql.conf"
        if [ "$POSTGRES_DB" != postgres ]; then
            echo "CREATE DATABASE \"$POSTGRES_DB\"" |
                as_postgres postgres --single -D "$PGDATA" postgres >/dev/null
        fi
        echo "postgres stand-in: initialized $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)"
    fi
    exec setpriv --reuid=postgres --regid=postgres --init-groups "$@"
fi

exec "$@"
