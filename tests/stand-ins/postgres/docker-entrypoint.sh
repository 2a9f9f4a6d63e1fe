#!/bin/sh
# The official postgres image's contract, in short: on an empty $PGDATA, initdb with POSTGRES_USER as the
# superuser (POSTGRES_PASSWORD, md5 from the network), create POSTGRES_DB; then run the server in the foreground.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    [ -n "${POSTGRES_PASSWORD:-}" ] || { echo "POSTGRES_PASSWORD is required" >&2; exit 1; }
    printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pwfile
    initdb --username="$POSTGRES_USER" --pwfile=/tmp/pwfile --auth-local=trust --auth-host=md5 >/dev/null
    rm -f /tmp/pwfile
    echo "host all all all md5" >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=''" -w start >/dev/null
    if [ "$POSTGRES_DB" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
             -c "CREATE DATABASE \"$POSTGRES_DB\"" >/dev/null
    fi
    pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
if [ "$1" = postgres ]; then
    shift
    exec postgres -c listen_addresses='*' "$@"
fi
exec "$@"
