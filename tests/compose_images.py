"""Base images for the compose test: the ones the project's files name, or stand-ins.

tests/test_compose.py runs docker-compose.yml and deploy/Dockerfile as they are, so it needs
the images they name: the Dockerfile's `FROM` (python:3.12-slim), and the images of db,
mailpit, pooler, prometheus and grafana. The test never pulls. An image the daemon already
has is used as it is. A missing one is built as a stand-in under the same name, and only in
a private daemon (scripts/with-dockerd, as CI runs it), where no registry may be reachable
and nothing else uses those names:

- a Debian 12 base made with mmdebstrap from Debian's package archive, with
  Python 3, imported as `fairq-stand-in/debian:bookworm`;
- on it, one Dockerfile per image from tests/compose_stand_ins/, built with compose on the
  host's network: PostgreSQL 16 from the pgserver wheel, PgBouncer and Prometheus from
  Debian's packages, a Mailpit stand-in and the virtualenv of the Python stand-in in Python.

Grafana has no stand-in: no package registry this project uses has it. Every stand-in
carries the label `fairq.stand-in` saying what it is, which the test prints.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
STAND_INS = Path(__file__).resolve().parent / "compose_stand_ins"
STAND_IN_LABEL = "fairq.stand-in"
BASE_IMAGE = "fairq-stand-in/debian:bookworm"
BASE_SUITE = "bookworm"
# What the stand-ins need of the base: the Python stand-in's venv, and the Mailpit and
# PgBouncer stand-ins' scripts run on this Python. (No dpkg path-exclude for docs: filtering
# made the extraction four times slower than the docs cost.)
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
# Set by scripts/with-dockerd: a directory in memory, removed with the daemon. mmdebstrap
# works about a third faster there than on disk.
SCRATCH_VARIABLE = "FAIRQ_PRIVATE_DOCKER_SCRATCH"

# The compose service whose image each stand-in replaces ("python": the Dockerfile's FROM).
ROLES = {
    "python": None,
    "postgres": "db",
    "mailpit": "mailpit",
    "pgbouncer": "pooler",
    "prometheus": "prometheus",
    "grafana": "grafana",
}
# Images with a stand-in; the others (grafana) are used only when the daemon has them.
DOCKERFILES = {
    "python": "python.Dockerfile",
    "postgres": "postgres.Dockerfile",
    "mailpit": "mailpit.Dockerfile",
    "pgbouncer": "pgbouncer.Dockerfile",
    "prometheus": "prometheus.Dockerfile",
}


class ImageError(RuntimeError):
    """A base image is missing and cannot be made here, or a build failed."""


@dataclass(frozen=True)
class Image:
    """One image the compose stack needs, and what the daemon holds under its name."""

    role: str
    name: str
    # The `fairq.stand-in` label: what stands in for the real image; None for a real image.
    stand_in: str | None
    present: bool

    def describe(self) -> str:
        """One line for the test's report."""
        if not self.present:
            return f"{self.name}: no image, and no stand-in can be made: not started"
        return f"{self.name}: {self.stand_in or 'the real image'}"


def required_images() -> dict[str, str]:
    """Role -> image name, read from deploy/Dockerfile and docker-compose.yml."""
    with (ROOT / "docker-compose.yml").open(encoding="utf-8") as f:
        services: dict[str, Any] = yaml.safe_load(f)["services"]
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text(encoding="utf-8")
    [python] = [line.split()[1] for line in dockerfile.splitlines() if line.startswith("FROM ")]
    return {
        role: python if service is None else str(services[service]["image"])
        for role, service in ROLES.items()
    }


def run(
    argv: list[str], env: Mapping[str, str], *, timeout: float, log: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` to completion; raise `ImageError` with its output when it fails.

    The output is also appended to `log` when given.
    """
    try:
        result = subprocess.run(
            argv, env=dict(env), capture_output=True, text=True, timeout=timeout, check=False,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{' '.join(argv)} still running after {timeout}s") from exc
    if log is not None:
        with log.open("a", encoding="utf-8") as f:
            f.write(f"$ {' '.join(argv)}\n{result.stdout}{result.stderr}\n")
    if result.returncode != 0:
        raise ImageError(
            f"{' '.join(argv)} exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    return result


def inspect(name: str, env: Mapping[str, str]) -> Image | None:
    """What the daemon holds under `name`, or None when it has no such image."""
    result = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", name],
        env=dict(env), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        return None
    labels = json.loads(result.stdout) or {}
    return Image(role="", name=name, stand_in=labels.get(STAND_IN_LABEL), present=True)


def survey(env: Mapping[str, str]) -> list[Image]:
    """Every image the stack needs, as the daemon holds it now."""
    found = []
    for role, name in required_images().items():
        held = inspect(name, env)
        found.append(Image(role, name, held.stand_in if held else None, present=held is not None))
    return found


def build_stand_ins(
    missing: list[Image], workdir: Path, env: Mapping[str, str], log: Path
) -> dict[str, float]:
    """Build a stand-in for each of `missing` that has one; return the seconds each step took.

    Needs root and mmdebstrap (the base), and the pgserver wheel (the PostgreSQL stand-in).
    """
    timings: dict[str, float] = {}
    roles = [image.role for image in missing if image.role in DOCKERFILES]
    if not roles:
        return timings
    started = time.monotonic()
    if inspect(BASE_IMAGE, env) is None:
        _build_base(workdir, env, log)
        timings["Debian base (mmdebstrap, import)"] = time.monotonic() - started
    started = time.monotonic()
    context = _context(workdir / f"stand-ins-{'-'.join(roles)}", roles)
    names = {image.role: image.name for image in missing}
    compose_file = context / "compose.json"
    compose_file.write_text(
        json.dumps(
            {
                "name": f"fairq-stand-ins-{'-'.join(roles)}",
                "services": {
                    role: {
                        "image": names[role],
                        "build": {
                            "context": str(context),
                            "dockerfile": DOCKERFILES[role],
                            # The daemon may have no bridge network; apt and pip need one.
                            "network": "host",
                        },
                    }
                    for role in roles
                },
            },
            indent=2,
        )
    )
    run(["docker", "compose", "-f", str(compose_file), "build"], env, timeout=900, log=log)
    timings[f"stand-ins ({', '.join(roles)})"] = time.monotonic() - started
    return timings


def _build_base(workdir: Path, env: Mapping[str, str], log: Path) -> None:
    """Debian 12 minbase with `BASE_PACKAGES`, imported as `BASE_IMAGE`."""
    if os.geteuid() != 0:
        raise ImageError("the stand-ins' Debian base is made with mmdebstrap as root")
    mmdebstrap = shutil.which("mmdebstrap") or shutil.which("mmdebstrap", path="/usr/sbin")
    if mmdebstrap is None:
        raise ImageError("mmdebstrap is not installed: apt-get install mmdebstrap")
    scratch = Path(env.get(SCRATCH_VARIABLE) or workdir)
    tarball = scratch / "fairq-stand-in-debian.tar"
    run(
        [mmdebstrap, "--quiet", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
         BASE_SUITE, str(tarball)],
        {**env, "TMPDIR": str(scratch)}, timeout=900, log=log,
    )  # fmt: skip
    label = f"Debian 12 minbase with {', '.join(BASE_PACKAGES)}, made by mmdebstrap"
    run(
        ["docker", "import", "--change", f'LABEL {STAND_IN_LABEL}="{label}"', str(tarball),
         BASE_IMAGE],
        env, timeout=300, log=log,
    )  # fmt: skip
    tarball.unlink()


def _context(context: Path, roles: list[str]) -> Path:
    """The build context of the stand-ins: their files, the CA bundle, PostgreSQL's binaries."""
    shutil.copytree(STAND_INS, context, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(_ca_bundle(), context / "build-ca.pem")
    if "postgres" in roles:
        # Found, not imported: importing pgserver does work (and warns) at import time.
        spec = importlib.util.find_spec("pgserver")  # the embedded extra, in the dev extra
        if spec is None or not spec.submodule_search_locations:
            raise ImageError("the pgserver wheel is not installed: pip install -e '.[dev]'")
        package = Path(spec.submodule_search_locations[0]).resolve()
        target = context / "pgserver"
        for part in ("bin", "lib", "share"):
            shutil.copytree(
                package / "pginstall" / part,
                target / "pgserver" / "pginstall" / part,
                ignore=shutil.ignore_patterns("*.a"),
            )
        # auditwheel's libraries, where the binaries' RPATH looks ($ORIGIN/../../../).
        libs = package.parent / "pgserver.libs"
        if libs.is_dir():
            shutil.copytree(libs, target / "pgserver.libs")
    return context


def _ca_bundle() -> Path:
    """The CA bundle pip uses here: where a proxy intercepts TLS, it trusts the proxy's CA."""
    for variable in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        value = os.environ.get(variable)
        if value and Path(value).is_file():
            return Path(value)
    default = ssl.get_default_verify_paths().openssl_cafile
    if Path(default).is_file():
        return Path(default)
    raise ImageError("no CA bundle found for the stand-in Python's pip (set PIP_CERT)")
