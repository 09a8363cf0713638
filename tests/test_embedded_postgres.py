"""The embedded PostgreSQL changes nothing outside its data directory, also when run as root.

PostgreSQL refuses to run as root; under root the server runs as an existing unprivileged user
(`nobody`), and only where that user can reach it as things are: no user is created, no mode or
owner of a directory above the data directory changes. Where it cannot, `start()` stops with a
message saying what to do instead. CI runs as root, so these run there for real.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pwd
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.embedded_postgres import (
    UNPRIVILEGED_USER,
    EmbeddedPostgres,
    EmbeddedPostgresError,
    free_port,
)
from tests import pg

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="what root does differently")


def pginstall() -> Path:
    """The binaries' tree in the pgserver wheel."""
    spec = importlib.util.find_spec("pgserver")
    assert spec is not None
    assert spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "pginstall"


def outside(datadir: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, uid, gid) of every directory above `datadir` and on the way to the binaries."""
    directories = {*datadir.parents, *pginstall().parents, pginstall()}
    directories |= {pginstall() / name for name in ("bin", "lib", "share")}
    found = {}
    for path in sorted(directories):
        info = path.stat()
        found[str(path)] = (info.st_mode, info.st_uid, info.st_gid)
    return found


def accounts() -> str:
    """A digest of the system's users and groups."""
    digest = hashlib.sha256()
    for name in ("/etc/passwd", "/etc/group", "/etc/shadow", "/etc/gshadow"):
        with_file = Path(name)
        if with_file.exists():
            digest.update(with_file.read_bytes())
    return digest.hexdigest()


@pytest.fixture
def place() -> Iterator[Path]:
    """A directory inside the checkout's .pgdata/ for this test's servers, deleted after."""
    path = pg.ROOT / ".pgdata" / f"embedded-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_server_changes_nothing_above_its_data_directory(place: Path) -> None:
    datadir = place / "new" / "data"  # "new" is created by start()
    before, users = outside(place), accounts()
    server = EmbeddedPostgres(datadir, free_port())
    try:
        server.start()
        pid = server.postmaster_pid()
        assert pid is not None
        owner = Path(f"/proc/{pid}").stat().st_uid
        if os.geteuid() == 0:
            assert owner == pwd.getpwnam(UNPRIVILEGED_USER).pw_uid
            assert owner != 0
            assert datadir.stat().st_uid == owner
        else:
            assert owner == os.geteuid()
    finally:
        server.destroy()
    assert outside(place) == before
    assert accounts() == users
    assert (place / "new").stat().st_mode & 0o777 == 0o755  # one it made, whatever the umask


@as_root
def test_as_root_a_parent_the_server_user_cannot_enter_stops_with_what_to_do(
    place: Path,
) -> None:
    private = place / "private"
    private.mkdir(mode=0o700)
    before, users = outside(private / "data"), accounts()
    server = EmbeddedPostgres(private / "data", free_port())
    with pytest.raises(EmbeddedPostgresError) as raised:
        server.start()
    message = str(raised.value)
    assert f"{private} (mode 0700, owner root)" in message
    assert f"runs as the unprivileged user {UNPRIVILEGED_USER!r}" in message
    for advice in ("set DATABASE_URL", "TEST_DATABASE_URL", "non-root user", "move the checkout"):
        assert advice in message
    assert outside(private / "data") == before
    assert private.stat().st_mode & 0o777 == 0o700
    assert accounts() == users
    assert not server.is_running()
    assert not (private / "data").exists()


@as_root
def test_as_root_an_existing_data_directory_keeps_its_owner(place: Path) -> None:
    """A data directory made by another unprivileged user (an earlier version ran as one)."""
    datadir = place / "data"
    server = EmbeddedPostgres(datadir, free_port())
    server.start()
    server.stop()
    # As if another account had made it: give it to a second existing unprivileged user.
    other = next(
        (p for p in pwd.getpwall() if 0 < p.pw_uid != pwd.getpwnam(UNPRIVILEGED_USER).pw_uid),
        None,
    )
    if other is None:
        pytest.skip("no second unprivileged account on this machine")
    for path in [datadir, *datadir.rglob("*")]:
        os.chown(path, other.pw_uid, other.pw_gid)
    again = EmbeddedPostgres(datadir, free_port())
    try:
        again.start()
        pid = again.postmaster_pid()
        assert pid is not None
        assert Path(f"/proc/{pid}").stat().st_uid == other.pw_uid
    finally:
        again.destroy()
