"""The embedded default: a private PostgreSQL in trajstore's data directory.

When no `TRAJSTORE_DATABASE_URL` is configured, trajstore runs its own server:
- binaries: the machine's own (`pg_config --bindir`, `/usr/lib/postgresql/*/bin`, `PATH`), else
  those shipped in the `pgserver` wheel; the choice is remembered with the cluster, because a
  data directory only opens with the major version that made it;
- PostgreSQL refuses to run as root, so as root the server runs as the `postgres` user when the
  machine has one, else as a `trajstore` system user created for it;
- it listens on a Unix socket in the data directory (the URL handed out, the fastest path) and on
  127.0.0.1:`embedded_port` with a generated password (for tools that only speak TCP);
- starting it twice is harmless; a stale pid file (a killed server, a reused pid) is cleared; a
  TCP port held by another program is reported with what to change.

Layout of the data directory:
    pgdata/            the cluster (owned by the server user, 0700)
    run/               the Unix socket
    postgres.log       the server's log
    embedded.json      binaries, user and port chosen at initialisation
    password           the TCP password (0600)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajstore.store import roles
from trajstore.store.errors import EmbeddedServerError
from trajstore.store.postgres_host import (
    ServerUser,
    blocking_parent,
    find_binaries,
    has_binaries,
    port_in_use,
    process_is_postgres,
    server_user,
)
from trajstore.store.roles import Role
from trajstore.store.settings import StoreSettings

log = logging.getLogger(__name__)

DATABASE = "trajstore"
DEFAULT_PORT = 54329
SUPERUSER = "trajstore"


@dataclass(frozen=True)
class Status:
    """Whether the embedded server is initialised and running, and where."""

    initialised: bool
    pid: int | None
    url: str | None
    data_dir: Path

    @property
    def running(self) -> bool:
        """True while a server process serves the data directory."""
        return self.pid is not None


class EmbeddedPostgres:
    """A private PostgreSQL server living in `data_dir`."""

    def __init__(
        self, data_dir: Path, port: int | None = None, bin_dir: Path | None = None
    ) -> None:
        self.data_dir = Path(data_dir).absolute()
        self._port = port
        self._bin_dir = bin_dir
        self.pgdata = self.data_dir / "pgdata"
        self.socket_dir = self.data_dir / "run"
        self.logfile = self.data_dir / "postgres.log"
        self.config_file = self.data_dir / "embedded.json"
        self.password_file = self.data_dir / "password"
        self.reused = False  #: whether the last start() found the server already running

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> EmbeddedPostgres:
        """The embedded server the settings describe."""
        return cls(settings.data_dir, settings.embedded_port, settings.pg_bin_dir)

    # -- what is there ------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The TCP port: the one asked for, else the one the cluster was made with, else 54329."""
        return self._port or int(self._config().get("port") or DEFAULT_PORT)

    def _config(self) -> dict[str, Any]:
        try:
            data: dict[str, Any] = json.loads(self.config_file.read_text())
        except FileNotFoundError:
            return {}
        return data

    @property
    def initialised(self) -> bool:
        """True once initdb has made the cluster."""
        return (self.pgdata / "PG_VERSION").is_file()

    def bin_dir(self) -> Path:
        """The binaries of this cluster: those it was made with, else the configured or best."""
        recorded = self._config().get("bin_dir")
        if recorded and self.initialised:
            path = Path(recorded)
            if not has_binaries(path):
                raise EmbeddedServerError(
                    f"the cluster in {self.pgdata} was made with the PostgreSQL binaries in "
                    f"{path}, which are gone; reinstall them or move the data directory away"
                )
            return path
        return find_binaries(self._bin_dir)

    def running_pid(self) -> int | None:
        """The server's pid when it runs; None when it does not (a stale pid file included)."""
        pid_file = self.pgdata / "postmaster.pid"
        try:
            first_line = pid_file.read_text().splitlines()[0]
        except (FileNotFoundError, IndexError):
            return None
        except PermissionError:  # not root and not the server user
            raise EmbeddedServerError(f"cannot read {pid_file}: permission denied") from None
        pid = int(first_line.strip())
        return pid if process_is_postgres(pid) else None

    def url(self) -> str:
        """The URL clients use: the Unix socket, as the server's superuser."""
        port = self._running_port() or self.port
        return f"postgresql://{SUPERUSER}@/{DATABASE}?host={self.socket_dir}&port={port}"

    def tcp_url(self) -> str:
        """The same database over TCP on 127.0.0.1, with the generated password."""
        port = self._running_port() or self.port
        password = self.password_file.read_text().strip()
        return f"postgresql://{SUPERUSER}:{password}@127.0.0.1:{port}/{DATABASE}"

    def _running_port(self) -> int | None:
        with contextlib.suppress(FileNotFoundError, IndexError, ValueError, PermissionError):
            return int((self.pgdata / "postmaster.pid").read_text().splitlines()[3])
        return None

    def status(self) -> Status:
        """Is the cluster there, is a server running, and at which URL."""
        pid = self.running_pid() if self.initialised else None
        return Status(self.initialised, pid, self.url() if pid else None, self.data_dir)

    # -- doing --------------------------------------------------------------------------------

    def start(self) -> str:
        """Make the cluster if needed, start the server unless it runs, and return its URL."""
        user = server_user()
        if not self.initialised:
            self._initialise(user)
        if self.running_pid() is not None:
            log.info("embedded PostgreSQL already runs in %s", self.data_dir)
            self.reused = True
            self._ensure_database()
            return self.url()
        self.reused = False
        self._clear_stale_pid_file()
        if port_in_use("127.0.0.1", self.port):
            raise EmbeddedServerError(
                f"port {self.port} on 127.0.0.1 is in use by another program; set "
                "TRAJSTORE_EMBEDDED_PORT to a free port, or TRAJSTORE_DATABASE_URL to use "
                "an existing server"
            )
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1"
        self._run(
            user,
            "pg_ctl",
            "start",
            "-D", str(self.pgdata),
            "-l", str(self.logfile),
            "-w", "-t", "60",
            "-o", options,
        )  # fmt: skip
        self._ensure_database()
        return self.url()

    def stop(self, mode: str = "fast") -> bool:
        """Stop the server; False when it was not running.

        `mode` is pg_ctl's: "fast" (the default) disconnects clients and shuts down cleanly;
        "immediate" stops like a crash, leaving recovery to the next start.
        """
        if not self.initialised or self.running_pid() is None:
            return False
        self._run(server_user(), "pg_ctl", "stop", "-D", str(self.pgdata), "-m", mode, "-w")
        return True

    def _initialise(self, user: ServerUser) -> None:
        bin_dir = self.bin_dir()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        blocked = blocking_parent(self.data_dir, user)
        if blocked is not None:
            raise EmbeddedServerError(
                f"the PostgreSQL server runs as user {user.name!r}, which cannot enter "
                f"{blocked} to reach the data directory {self.data_dir}; choose a "
                "TRAJSTORE_DATA_DIR it can reach (for example under /var/lib or /tmp)"
            )
        if blocking_parent(bin_dir / "postgres", user) is not None:
            bin_dir = self._private_binaries(bin_dir)
        for directory in (self.pgdata, self.socket_dir):
            directory.mkdir(mode=0o700, exist_ok=True)
            os.chown(directory, user.uid, user.gid)
        self.password_file.write_text(secrets.token_urlsafe(24) + "\n")
        self.password_file.chmod(0o600)
        os.chown(self.password_file, user.uid, user.gid)
        self.logfile.touch()
        os.chown(self.logfile, user.uid, user.gid)
        self._run(
            user,
            "initdb",
            "-D", str(self.pgdata),
            "-U", SUPERUSER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            f"--pwfile={self.password_file}",
            "-E", "UTF8",
            "--locale=C",
            bin_dir=bin_dir,
        )  # fmt: skip
        config = {"bin_dir": str(bin_dir), "user": user.name, "port": self.port}
        self.config_file.write_text(json.dumps(config, indent=2) + "\n")
        log.info("initialised embedded PostgreSQL in %s with %s", self.pgdata, bin_dir)

    def _private_binaries(self, bin_dir: Path) -> Path:
        """Copy the server installation into the data directory, where the server user can go.

        As root, the server user often cannot reach the binaries: pgserver's live in a virtual
        environment, typically under root's home. Rather than widen permissions on someone's
        directories, the installation (about 30 MB) is copied next to the data, once. The
        wheel's binaries find their shared libraries through a relative RPATH
        (`$ORIGIN/../../../pgserver.libs`), so the copy keeps the layout from site-packages down.
        """
        install = bin_dir.parent  # .../site-packages/pgserver/pginstall
        root = install.parent.parent  # .../site-packages
        target = self.data_dir / "pginstall"
        parts = [install / part for part in ("bin", "lib", "share")]
        parts += [p for p in root.glob("pgserver.libs") if p.is_dir()]
        for source in parts:
            if source.is_dir():
                destination = target / source.relative_to(root)
                shutil.copytree(source, destination, symlinks=True, dirs_exist_ok=True)
        for path in [target, *target.rglob("*")]:
            if path.is_symlink():
                continue
            path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
        log.info("copied the PostgreSQL installation from %s to %s", install, target)
        return target / bin_dir.relative_to(root)

    def _clear_stale_pid_file(self) -> None:
        # Called once we know no server runs here. A killed server leaves its pid file and the
        # socket's lock file behind; if its pid now names another process (or a zombie nobody
        # reaped), PostgreSQL would refuse to start, so both go. The socket directory is private
        # to this data directory: no other server can be using it.
        stale = [self.pgdata / "postmaster.pid", *self.socket_dir.glob(".s.PGSQL.*.lock")]
        for path in stale:
            if path.exists():
                log.warning("removing stale %s (its server is not running)", path)
                path.unlink()

    def _ensure_database(self) -> None:
        exists = self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE}'")
        if exists.strip() != "1":
            self._psql(f'CREATE DATABASE "{DATABASE}"')

    def _psql(self, sql: str) -> str:
        port = str(self._running_port() or self.port)
        return self._run(
            server_user(),
            "psql",
            "-X", "-q", "-t", "-A",
            "-h", str(self.socket_dir),
            "-p", port,
            "-U", SUPERUSER,
            "-d", "postgres",
            "-v", "ON_ERROR_STOP=1",
            "-c", sql,
        )  # fmt: skip

    def _run(self, user: ServerUser, program: str, *args: str, bin_dir: Path | None = None) -> str:
        executable = (bin_dir or self.bin_dir()) / program
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "LANG": "C"}
        try:
            done = subprocess.run(
                [str(executable), *args],
                capture_output=True,
                text=True,
                cwd=self.data_dir,
                env=env,
                timeout=120,
                **user.run_kwargs(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise EmbeddedServerError(f"could not run {program}: {exc}") from exc
        if done.returncode != 0:
            tail = self._log_tail() if program == "pg_ctl" else ""
            raise EmbeddedServerError(
                f"{program} {args[0] if args else ''} failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()}{tail}"
            )
        return str(done.stdout)

    def _log_tail(self, lines: int = 15) -> str:
        try:
            text = self.logfile.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\nlast lines of " + str(self.logfile) + ":\n" + "\n".join(text)


def database_url(settings: StoreSettings | None = None) -> str:
    """The configured database URL, or the embedded server's after starting it if needed."""
    settings = settings or StoreSettings()
    if settings.database_url:
        return settings.database_url
    return EmbeddedPostgres.from_settings(settings).start()


def role_database_url(role: Role, settings: StoreSettings | None = None) -> str:
    """The URL a process of `role` connects with (`store.roles.url_for`): its own configured
    URL, the embedded server's socket as that role, or the one configured URL."""
    settings = settings or StoreSettings()
    recorder = role == roles.RECORDER_ROLE
    configured = settings.recorder_database_url if recorder else settings.projector_database_url
    if configured:
        return configured
    url_file = (
        settings.recorder_database_url_file if recorder else settings.projector_database_url_file
    )
    if url_file is not None:
        return roles.read_url_file(url_file)
    owner = database_url(settings)
    return roles.url_for(role, owner, None, embedded=not settings.database_url)
