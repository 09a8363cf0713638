# Stand-in for python:3.12-slim (tests/compose_images.py): Debian 12's Python 3.11 in a
# virtualenv first on PATH. The project supports 3.11; the real image has 3.12.
FROM fairq-stand-in/debian:bookworm
LABEL fairq.stand-in="python:3.12-slim stand-in: Debian 12's Python 3.11 in a virtualenv"
# The CA bundle of the machine that built it: pip in the project's build may have to trust an
# intercepting proxy. On a machine without one it is the usual public bundle.
COPY build-ca.pem /usr/local/share/fairq-stand-in/build-ca.pem
RUN python3 -m venv /opt/python && /opt/python/bin/python -m pip --version
ENV PATH=/opt/python/bin:$PATH \
    LANG=C.UTF-8 \
    PIP_CERT=/usr/local/share/fairq-stand-in/build-ca.pem \
    SSL_CERT_FILE=/usr/local/share/fairq-stand-in/build-ca.pem
CMD ["python3"]
