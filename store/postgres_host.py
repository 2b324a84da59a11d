"""What the embedded server needs of this machine (`store.embedded`): PostgreSQL's binaries, an
unprivileged account to run them as, directories that account can enter, a free port.

- binaries: the machine's own (`pg_config --bindir`, `/usr/lib/postgresql/*/bin`, `PATH`), else
  those shipped in the `pgserver` wheel;
- PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user when the
  machine has one, else as a `trajstore` system user created for it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import socket
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajstore.store.errors import EmbeddedServerError

_REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres", "psql")


@dataclass(frozen=True)
class ServerUser:
    """The OS account the server runs as."""

    name: str
    uid: int
    gid: int

    def run_kwargs(self) -> dict[str, Any]:
        """`subprocess` arguments that drop root privileges to this user (none if already it)."""
        if os.geteuid() != 0:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def has_binaries(directory: Path) -> bool:
    """Whether `directory` holds initdb, pg_ctl, postgres and psql."""
    return all((directory / name).is_file() for name in _REQUIRED_BINARIES)


def pgserver_binaries() -> Path | None:
    """The server binaries shipped in the `pgserver` wheel, when it is installed."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        return None
    directory = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return directory if has_binaries(directory) else None


def find_binaries(preferred: Path | None = None) -> Path:
    """The directory holding initdb, pg_ctl, postgres and psql: the machine's, else pgserver's.

    `preferred` (TRAJSTORE_PG_BIN_DIR) must hold them when given.
    """
    if preferred is not None:
        if not has_binaries(preferred):
            raise EmbeddedServerError(
                f"{preferred} does not hold the PostgreSQL binaries {', '.join(_REQUIRED_BINARIES)}"
            )
        return preferred
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True
            )
            candidates.append(Path(out.stdout.strip()))
    candidates.extend(
        sorted(
            Path("/usr/lib/postgresql").glob("*/bin"),
            key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
            reverse=True,
        )
    )
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)
    wheel = pgserver_binaries()
    if wheel is not None:
        candidates.append(wheel)
    for directory in candidates:
        if has_binaries(directory):
            return directory
    raise EmbeddedServerError(
        "no PostgreSQL server binaries found (looked for pg_config, /usr/lib/postgresql, PATH "
        "and the pgserver package); install PostgreSQL or `pip install pgserver`, or set "
        "TRAJSTORE_DATABASE_URL to an existing server"
    )


def server_user() -> ServerUser:
    """The account to run the server as: ourselves, or an unprivileged one when we are root."""
    if os.geteuid() != 0:
        entry = pwd.getpwuid(os.geteuid())
        return ServerUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
    for name in ("postgres", "trajstore"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return ServerUser(entry.pw_name, entry.pw_uid, entry.pw_gid)
    useradd = shutil.which("useradd")
    if useradd is None:
        raise EmbeddedServerError(
            "running as root, PostgreSQL needs an unprivileged user: create one named "
            "'trajstore' (useradd is not available here)"
        )
    subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "trajstore"],
        check=True,
        capture_output=True,
    )
    entry = pwd.getpwnam("trajstore")
    return ServerUser(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _can_enter(path: Path, user: ServerUser) -> bool:
    st = path.stat()
    if user.uid == 0:
        return True
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == user.gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def blocking_parent(path: Path, user: ServerUser) -> Path | None:
    """The first directory on the way to `path` that `user` cannot enter, if any."""
    resolved = path.resolve()
    for parent in [*reversed(resolved.parents), resolved]:
        if not _can_enter(parent, user):
            return parent
    return None


def port_in_use(host: str, port: int) -> bool:
    """Whether some program already holds `port` on `host` (we cannot bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # A port whose last connections linger in TIME_WAIT is free: only a listener counts.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def process_is_postgres(pid: int) -> bool:
    """Whether `pid` (a pid file's) is a live PostgreSQL process, as far as this machine shows."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's: look closer
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc to look at: assume the pid file is right
    return b"postgres" in cmdline
