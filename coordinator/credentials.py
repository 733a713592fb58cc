"""Per-device MQTT credentials for Mosquitto: each device may write only its own upstream topics and read
only its own downstream ones (ARCHITECTURE.md, "Wire"), and only the coordinator reads the fleet's reports.

Mosquitto substitutes the username for ``%u`` in ACL patterns, so one pattern covers every device as
long as a device's username is its device id. Passwords are hashed by ``mosquitto_passwd``.

MQTT client ids are not confined by ACLs: any client that logs in may connect with any client id, and the
broker then disconnects the client that held it (a "session takeover"). ``broker.conf`` therefore sets
``use_username_as_clientid true``: Mosquitto replaces every client id with the client's user name, so a device
can only ever be its own id, and only the coordinator's user can be the coordinator. The coordinator's user
is for the coordinator alone; each ingest worker (coordinator/ingest.py) gets its own user
(``<coordinator user>-ingest-<i>``, read-only on the reports), since two connections of one user would take
each other's (one) client id.
"""
from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from pathlib import Path

from edge.protocol import wire
from edge.runtime.config import ConfigError

DEVICE_WRITES = ("checkin", "report", "status")
DEVICE_READS = ("plan", "ack", "pace")


def ingest_users(coordinator_user: str, n: int) -> list[str]:
    return [f"{coordinator_user}-ingest-{i}" for i in range(1, n + 1)]


def acl_text(fleet: str, coordinator_user: str, ingest: list[str] = ()) -> str:
    root = f"fedge/v1/{fleet}"
    lines = [f"user {coordinator_user}", f"topic readwrite {root}/#", ""]
    for u in ingest:  # a worker reads the reports (on a shared subscription) and sends nothing
        lines += [f"user {u}", f"topic read {root}/report/#", ""]
    lines += [f"pattern write {root}/{k}/%u" for k in DEVICE_WRITES]
    lines += [f"pattern read {root}/{k}/%u" for k in DEVICE_READS]
    return "\n".join(lines) + "\n"


def check_username(user: str) -> None:
    """A device id must be valid in the protocol (it is a topic level) and as a Mosquitto user name (the
    password file is ``user:hash`` lines, so ':' cannot appear). Raises ConfigError with one line."""
    if not wire.ID_RE.match(user):
        raise ConfigError(f"id {user!r}: use 1-128 of A-Z a-z 0-9 _ . : - (no '+', '#', '/' or spaces: it becomes a "
                          "topic level)")
    if ":" in user:
        raise ConfigError(f"id {user!r}: Mosquitto user names cannot contain ':' (its password file separates user "
                          "and hash with ':'); give this device an id without ':'")


def broker_conf(passwd: Path, acl: Path) -> str:
    """The lines of mosquitto.conf that use these files (in the listener's block, after its ``listener`` line:
    ``use_username_as_clientid`` is a listener setting)."""
    return (f"allow_anonymous false\npassword_file {Path(passwd).resolve()}\nacl_file {Path(acl).resolve()}\n"
            "# a client's id is its user name, whatever it asks for: no one can take another's session\n"
            "use_username_as_clientid true\n")


def write_mosquitto_auth(out: str | Path, fleet: str, device_ids: list[str], *, coordinator_user: str = "coordinator",
                         passwords: dict[str, str] | None = None, ingest_workers: int = 0) -> dict[str, Path]:
    """Write ``passwd`` (hashed), ``acl``, ``broker.conf`` (the mosquitto.conf lines that use them) and
    ``credentials.json`` (clear-text passwords, for provisioning: keep it out of the broker host) under
    ``out``; returns their paths. ``ingest_workers``: that many read-only users for ingest workers."""
    ingest = ingest_users(coordinator_user, ingest_workers)
    for u in [coordinator_user, *ingest, *device_ids]:
        check_username(u)
    if len(set(device_ids) | {coordinator_user} | set(ingest)) != len(device_ids) + 1 + len(ingest):
        raise ConfigError("device ids must be distinct and differ from the coordinator's (and its ingest workers') "
                          "user names")
    if not device_ids:
        raise ConfigError("no device ids given")
    exe = shutil.which("mosquitto_passwd")
    if exe is None:
        raise ConfigError("mosquitto_passwd not found (apt-get install mosquitto)")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    users = [coordinator_user, *ingest, *device_ids]
    pw = {u: (passwords or {}).get(u) or secrets.token_urlsafe(18) for u in users}
    passwd = out / "passwd"
    passwd.write_text("")
    for u in users:
        subprocess.run([exe, "-b", str(passwd), u, pw[u]], check=True, capture_output=True)
    passwd.chmod(0o600)
    acl = out / "acl"
    acl.write_text(acl_text(fleet, coordinator_user, ingest))
    conf = out / "broker.conf"
    conf.write_text(broker_conf(passwd, acl))
    creds = out / "credentials.json"
    creds.write_text(json.dumps(pw, indent=1))
    creds.chmod(0o600)
    return {"passwd": passwd, "acl": acl, "conf": conf, "credentials": creds}
