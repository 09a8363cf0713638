# Stand-in for postgres:16 (tests/compose_images.py): the PostgreSQL 16 binaries of the
# pgserver wheel (a dependency of the project's `embedded` extra) on Debian 12, and an
# entrypoint doing what the official image's does for the variables fairq's compose file sets.
FROM fairq-stand-in/debian:bookworm
LABEL fairq.stand-in="postgres:16 stand-in: PostgreSQL 16 from the pgserver wheel on Debian 12"
RUN groupadd --system --gid 999 postgres \
    && useradd --system --uid 999 --gid postgres --home-dir /var/lib/postgresql postgres \
    && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
    && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql
# The wheel's layout is kept: its binaries find their libraries at $ORIGIN/../../../pgserver.libs.
COPY pgserver /opt/pgserver
COPY postgres-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
ENV PATH=/opt/pgserver/pgserver/pginstall/bin:$PATH \
    LANG=C.UTF-8 \
    PGDATA=/var/lib/postgresql/data
RUN postgres --version && pg_isready --version
VOLUME /var/lib/postgresql/data
ENTRYPOINT ["/usr/local/bin/docker-entrypoint.sh"]
# As in the official image: SIGINT is PostgreSQL's fast shutdown.
STOPSIGNAL SIGINT
CMD ["postgres"]
