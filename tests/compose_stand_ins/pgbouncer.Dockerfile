# Stand-in for edoburu/pgbouncer (tests/compose_images.py): Debian 12's PgBouncer 1.18 and an
# entrypoint that writes pgbouncer.ini from the same variables as that image's.
FROM fairq-stand-in/debian:bookworm
LABEL fairq.stand-in="edoburu/pgbouncer stand-in: Debian 12's PgBouncer 1.18"
RUN printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-exclude=/usr/share/man/*' \
        'path-exclude=/usr/share/locale/*' >/etc/dpkg/dpkg.cfg.d/stand-in-slim \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Use-Pty=0 pgbouncer >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && rm -f /etc/pgbouncer/pgbouncer.ini /etc/pgbouncer/userlist.txt \
    && chown -R postgres:postgres /etc/pgbouncer \
    && pgbouncer --version
COPY pgbouncer_entrypoint.py /usr/local/bin/pgbouncer-entrypoint.py
USER postgres
ENTRYPOINT ["python3", "/usr/local/bin/pgbouncer-entrypoint.py"]
CMD ["pgbouncer", "/etc/pgbouncer/pgbouncer.ini"]
