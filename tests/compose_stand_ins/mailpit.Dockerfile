# Stand-in for axllent/mailpit (tests/compose_images.py): an SMTP sink with the one endpoint
# of Mailpit's API the compose test reads (GET /api/v1/messages), in Python's standard library.
FROM fairq-stand-in/debian:bookworm
LABEL fairq.stand-in="axllent/mailpit stand-in: an SMTP sink and /api/v1/messages in Python"
COPY mailpit.py /usr/local/bin/mailpit-stand-in.py
ENTRYPOINT ["python3", "/usr/local/bin/mailpit-stand-in.py"]
