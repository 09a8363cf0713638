# Stand-in for prom/prometheus (tests/compose_images.py): Debian 12's Prometheus 2.42, run as
# the official image runs it (entrypoint the binary, user nobody, data in /prometheus).
FROM fairq-stand-in/debian:bookworm
LABEL fairq.stand-in="prom/prometheus stand-in: Debian 12's Prometheus 2.42"
# Its web UI's JavaScript is left out: the test reads the HTTP API.
RUN printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-exclude=/usr/share/man/*' \
        'path-exclude=/usr/share/locale/*' 'path-exclude=/usr/share/javascript/*' \
        >/etc/dpkg/dpkg.cfg.d/stand-in-slim \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o Dpkg::Use-Pty=0 prometheus >/dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus && chown nobody:nogroup /prometheus \
    && prometheus --version
USER nobody
WORKDIR /prometheus
VOLUME /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
