"""Bad input to the local stack: each failure names its cause and its fix (no services needed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid

import pytest

from lib import config
from lib.local import stack
from lib.local.stack import fetch, kafka, process
from lib.local.stack.process import StackError


@pytest.fixture
def tmp_conf(tmp_path, conf):
    """The local conf with its stack folder moved to a temporary one."""
    return config.apply_overrides(conf, {"CDC__STACK__DIR": str(tmp_path / "stack")})


@pytest.fixture
def busy_port():
    """A port something listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def dead_pid() -> int:
    """The pid of a process that has already exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_busy_port_names_service_port_and_setting(tmp_conf, busy_port):
    conf = config.apply_overrides(tmp_conf, {"CDC__KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{busy_port}"})
    with pytest.raises(StackError, match=rf"kafka: port {busy_port} on 127.0.0.1 is already in use.*"
                                         r"kafka.bootstrap_servers in conf/local.yml"):
        kafka.start(conf, stack.stack_dir(conf), log=lambda line: None)


def test_missing_java_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StackError, match=r"java not found on PATH: install a JDK 17"):
        kafka.java()


def test_old_java_is_refused(monkeypatch, tmp_path):
    fake = tmp_path / "java"
    fake.write_text('#!/bin/sh\necho \'openjdk version "11.0.2"\' >&2\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StackError, match=r"too old.*need Java 17"):
        kafka.java()


def test_failed_download_names_log_and_leaves_no_cache(tmp_path):
    pom = tmp_path / "pom.xml"
    pom.write_text(
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>local.cdc</groupId><artifactId>t</artifactId><version>1</version><packaging>pom</packaging>"
        "<dependencies><dependency><groupId>local.cdc.missing</groupId><artifactId>no-such-artifact</artifactId>"
        "<version>0.0.0</version></dependency></dependencies></project>"
    )
    target, log = tmp_path / "jars", tmp_path / "fetch.log"
    expected = r"download of test jars failed \(mvn exit 1; see .*fetch.log\).*Maven Central"
    with pytest.raises(StackError, match=expected):
        fetch.copy_dependencies(pom, target, tmp_path / "m2", log, "test jars")
    assert not fetch.cached(target)
    assert "no-such-artifact" in log.read_text()


def test_service_that_never_answers_times_out_naming_the_log(tmp_path):
    log = tmp_path / "svc.log"
    log.write_text("starting\nstill starting\n")
    with pytest.raises(StackError, match=r"svc did not become ready within 1 s.*svc.log.*start_timeout_s") as error:
        process.wait_ready("svc", lambda: False, 1, log)
    assert "still starting" in error.value.details


def test_service_that_exits_during_startup_shows_its_log(tmp_path):
    log, pid_file = tmp_path / "svc.log", tmp_path / "svc.pid"
    pid = process.start(["sh", "-c", "echo boom: bad config; exit 3"], log, pid_file)
    with pytest.raises(StackError, match=r"svc exited during start-up; its log is .*svc.log") as error:
        process.wait_ready("svc", lambda: False, 10, log, pid)
    assert "boom: bad config" in error.value.details
    assert process.read_pid(pid_file) == pid


def test_stale_pid_file_shows_in_status_and_start_clears_it(tmp_conf, monkeypatch):
    where = kafka.files(stack.stack_dir(tmp_conf))
    where["pid"].parent.mkdir(parents=True)
    where["pid"].write_text(f"{dead_pid()}\n")
    assert kafka.status(tmp_conf, stack.stack_dir(tmp_conf))["state"] == "stale pid file"
    with pytest.raises(StackError, match=r"kafka: stale pid file .*kafka.pid .*run `make down`"):
        process.running_pid("kafka", where["pid"], kafka.MARKER)
    lines = []
    monkeypatch.setattr(process, "require_free_port", lambda *args: None)
    assert process.claim("kafka", where["pid"], kafka.MARKER, [("127.0.0.1", 1, "kafka.port")], log=lines.append)
    assert not where["pid"].exists()
    assert "cleared a stale pid file" in lines[0] and "no longer runs kafka" in lines[0]
    where["pid"].write_text(f"{dead_pid()}\n")
    kafka.stop(stack.stack_dir(tmp_conf), log=lambda line: None)
    assert not where["pid"].exists()


def test_cli_error_is_one_line_with_exit_code_1():
    done = subprocess.run([sys.executable, "-m", "lib.local.stack", "--target", "nowhere", "status"],
                          capture_output=True, text=True, cwd=config.PROJECT_ROOT)
    assert done.returncode == 1
    assert done.stderr.startswith("error: no configuration for target 'nowhere'")
    assert len(done.stderr.strip().splitlines()) == 1


def test_local_secrets_are_generated_once_and_never_overwritten(tmp_path, conf):
    file = tmp_path / "secrets.env"
    stack.ensure_local_secrets(conf, environ={"CDC_PG_PASSWORD": "given"}, path=file, log=lambda line: None)
    first = file.read_text()
    assert "CDC_PG_PASSWORD" not in first and "CDC_PG_ADMIN_PASSWORD=" in first
    assert oct(file.stat().st_mode & 0o777) == "0o600"
    stack.ensure_local_secrets(conf, environ={"CDC_PG_PASSWORD": "given"}, path=file, log=lambda line: None)
    assert file.read_text() == first


def test_kafka_cluster_id_never_starts_with_a_dash(monkeypatch):
    """One uuid in 64 encodes to an id starting with '-', which Kafka's format tool took for an option (CI failed)."""
    dashed = uuid.UUID(bytes=bytes([0xF8]) + bytes(15))
    plain = uuid.UUID(bytes=bytes([0x10]) + bytes(15))
    drawn = iter([dashed, plain])
    monkeypatch.setattr(kafka.uuid, "uuid4", lambda: next(drawn))
    assert kafka.base64.urlsafe_b64encode(dashed.bytes).decode().startswith("-")
    assert kafka.new_cluster_id() == kafka.base64.urlsafe_b64encode(plain.bytes).decode().rstrip("=")
