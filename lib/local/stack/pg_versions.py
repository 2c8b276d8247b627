"""PostgreSQL servers of other majors beside the stack's own, for the version matrix (make compat).

Each major runs as a throwaway cluster like the stack's (postgres.py: logical decoding, TLS with the
stack's certificate, the same roles and secrets), on port stack.postgres_versions.port_base + major,
in .stack/postgres-<major>/. The server binaries are zonky's builds of PostgreSQL
(io.zonky.test.postgres:embedded-postgres-binaries-<platform>), fetched from Maven Central by Maven
and unpacked next to the cluster, so the server user can run them wherever the project lives.
"""

from __future__ import annotations

import copy
import platform
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

from lib import config
from lib.local.stack import fetch, postgres, process
from lib.local.stack.process import StackError

ARTIFACT = "io.zonky.test.postgres:embedded-postgres-binaries-{platform}:{version}"
PLATFORMS = {"x86_64": "linux-amd64", "amd64": "linux-amd64", "aarch64": "linux-arm64v8", "arm64": "linux-arm64v8"}


def versions(conf: dict) -> dict[int, str]:
    """Major -> zonky version, from stack.postgres_versions.versions."""
    return {int(major): str(version) for major, version in
            config.get(conf, "stack.postgres_versions.versions").items()}


def majors(conf: dict, wanted: str | list | None = None) -> list[int]:
    """The majors asked for ('13,18', a list, or None for all); an unknown one names the setting."""
    known = versions(conf)
    if wanted is None:
        return sorted(known)
    chosen = [int(m) for m in (wanted.split(",") if isinstance(wanted, str) else wanted) if str(m).strip()]
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise StackError(f"no PostgreSQL {', '.join(map(str, unknown))} in stack.postgres_versions.versions "
                         f"(known: {', '.join(map(str, sorted(known)))}); add its zonky version there")
    return chosen


def conf_for(conf: dict, major: int) -> dict:
    """conf pointed at the server of that major: its port, folder and binaries; everything else unchanged.

    Makes the major's folder (.stack/postgres-<major>) when it does not exist yet.
    """
    version = versions(conf)[major]
    port = int(config.get(conf, "stack.postgres_versions.port_base")) + major
    other = copy.deepcopy(conf)
    other["source"]["port"] = port
    other["stack"]["postgres"] = {**other["stack"]["postgres"], "folder": f"postgres-{major}",
                                  "version": version}
    other["stack"]["postgres"]["bin_dir"] = str(binaries_home(other) / "bin")
    return other


def binaries_home(server_conf: dict) -> Path:
    """Where the major's binaries are unpacked: inside its cluster folder, which the server user can reach."""
    home = postgres.home(postgres_stack_dir(server_conf), server_conf)
    return home / f"pg-{config.get(server_conf, 'stack.postgres.version')}"


def postgres_stack_dir(conf: dict) -> Path:
    """The stack's folder (stack.dir)."""
    return config.project_path(config.get(conf, "stack.dir"))


def artifact(version: str) -> str:
    """Maven coordinates of zonky's binaries of that version for this machine."""
    machine = platform.machine().lower()
    if machine not in PLATFORMS:
        raise StackError(f"no PostgreSQL binaries for {machine} in the version matrix (zonky builds "
                         f"{', '.join(sorted(set(PLATFORMS.values())))}); run it on one of those")
    return ARTIFACT.format(platform=PLATFORMS[machine], version=version)


def ensure_binaries(server_conf: dict, log=print) -> Path:
    """Download (Maven, cached in .stack/cache/m2) and unpack the major's server binaries; their folder."""
    target = binaries_home(server_conf)
    coordinates = artifact(config.get(server_conf, "stack.postgres.version"))
    if fetch.cached(target, coordinates + "\n"):
        return target
    folder = postgres_stack_dir(server_conf)
    where = fetch.paths(folder)
    log(f"{postgres.folder_name(server_conf)} fetching {coordinates}")
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        fetch.maven(["dependency:copy", f"-Dartifact={coordinates}", f"-DoutputDirectory={staging}"],
                    where["m2"], where["logs"] / f"fetch-{target.name}.log", f"PostgreSQL {target.name}")
        jar = next(staging.glob("*.jar"))
        with zipfile.ZipFile(jar) as archive:
            inner = next(name for name in archive.namelist() if name.endswith(".txz"))
            with archive.open(inner) as packed, tarfile.open(fileobj=packed, mode="r:xz") as tar:
                tar.extractall(staging, filter="tar")
        jar.unlink()
        (staging / fetch.DONE).write_text(coordinates + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        target.chmod(0o755)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def up(conf: dict, wanted=None, log=print) -> dict[int, dict]:
    """Start the servers of the majors asked for (all by default); major -> its conf."""
    folder = postgres_stack_dir(conf)
    started = {}
    with process.stack_lock(folder):  # two test workers may ask for the same server at once
        for major in majors(conf, wanted):
            server_conf = conf_for(conf, major)
            ensure_binaries(server_conf, log=log)
            postgres.start(server_conf, folder, log=lambda line, major=major: log(line.replace(
                "postgres ", f"postgres-{major}", 1)))
            started[major] = server_conf
    return started


def down(conf: dict, log=print) -> None:
    """Stop every version server that runs."""
    folder = postgres_stack_dir(conf)
    for major in majors(conf):
        if (folder / f"postgres-{major}").exists():
            server_conf = conf_for(conf, major)
            postgres.stop(server_conf, folder, log=lambda line, major=major: log(line.replace(
                "postgres ", f"postgres-{major}", 1)))


def status(conf: dict) -> list[dict]:
    """A status row per version server that was ever started here."""
    folder = postgres_stack_dir(conf)
    rows = []
    for major in majors(conf):
        if (folder / f"postgres-{major}").exists():
            rows.append(postgres.status(conf_for(conf, major), folder))
    return rows
