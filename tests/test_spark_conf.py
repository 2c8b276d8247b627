"""Spark settings from conf: local paths made absolute, a metastore per process, Derby's lock seen from outside."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap

import pytest
from pyspark import cloudpickle

from lib import config, spark


def test_relative_warehouse_metastore_and_derby_home_become_absolute():
    settings = spark.resolve_locations({
        "spark.sql.warehouse.dir": ".stack/lake/warehouse",
        spark.METASTORE_URL_KEY: "jdbc:derby:;databaseName=.stack/lake/_metastore/metastore_db;create=true",
        spark.JAVA_OPTIONS_KEY: "-Xss4m -Dderby.system.home=.stack/lake/_metastore",
        "spark.sql.shuffle.partitions": 4})
    root = str(config.PROJECT_ROOT)
    assert settings["spark.sql.warehouse.dir"] == f"{root}/.stack/lake/warehouse"
    url = f"jdbc:derby:;databaseName={root}/.stack/lake/_metastore/metastore_db;create=true"
    assert settings[spark.METASTORE_URL_KEY] == url
    assert settings[spark.JAVA_OPTIONS_KEY] == f"-Xss4m -Dderby.system.home={root}/.stack/lake/_metastore"
    assert settings["spark.sql.shuffle.partitions"] == "4"


def test_absolute_paths_and_other_urls_stay_as_given():
    given = {"spark.sql.warehouse.dir": "abfss://lake@acct.dfs.core.windows.net/warehouse",
             spark.METASTORE_URL_KEY: "jdbc:postgresql://db:5432/metastore"}
    assert spark.resolve_locations(given) == given
    assert spark.derby_path("jdbc:derby:/abs/metastore_db;create=true") == "/abs/metastore_db"
    assert spark.derby_path("jdbc:derby:memory:ms;create=true") is None
    assert spark.derby_path("jdbc:derby://host:1527/ms") is None


def test_with_metastore_gives_a_process_its_own_hive_metastore(tmp_path):
    conf = {"spark": {"settings": {spark.JAVA_OPTIONS_KEY: "-Xss4m -Dderby.system.home=.stack/lake/_metastore"}}}
    settings = spark.with_metastore(conf, str(tmp_path))["spark"]["settings"]
    assert settings[spark.CATALOG_KEY] == "hive"
    assert settings["spark.sql.warehouse.dir"] == f"{tmp_path}/warehouse"
    assert spark.derby_path(settings[spark.METASTORE_URL_KEY]) == f"{tmp_path}/metastore_db"
    assert settings[spark.JAVA_OPTIONS_KEY] == f"-Xss4m -Dderby.system.home={tmp_path}"
    assert conf["spark"]["settings"] == {spark.JAVA_OPTIONS_KEY: "-Xss4m -Dderby.system.home=.stack/lake/_metastore"}


def test_derby_in_use_sees_a_lock_held_by_another_process(tmp_path):
    (tmp_path / "dbex.lck").write_bytes(b"")
    assert not spark.derby_in_use(str(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys
        handle = open({str(tmp_path / "dbex.lck")!r}, "a+b")
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("locked", flush=True)
        sys.stdin.read()
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert spark.derby_in_use(str(tmp_path))
    finally:
        holder.communicate("", timeout=30)
    assert not spark.derby_in_use(str(tmp_path))
    assert not spark.derby_in_use(str(tmp_path / "missing"))


def test_the_local_driver_takes_its_log_levels_from_conf(spark_session):
    levels = config.get(config.load("local"), "spark.log_levels")
    assert levels["org.apache.hadoop.hive.metastore.ObjectStore"] == "ERROR"
    manager = spark_session.sparkContext._jvm.org.apache.logging.log4j.LogManager
    level = lambda name: manager.getLogger(name).getLevel().toString()  # noqa: E731
    assert {name: level(name) for name in levels} == levels
    assert level("org.apache.spark.sql.delta.DeltaLog") == "WARN"  # every other logger as before


def test_no_log_levels_leave_the_java_options_alone():
    assert spark.with_log_levels({"spark.driver.extraJavaOptions": "-Dx=1"}, {}) == \
        {"spark.driver.extraJavaOptions": "-Dx=1"}


def test_local_metastore_follows_the_lake_root_so_two_targets_keep_their_views_apart(tmp_path):
    demo = config.load("local")
    other = config.apply_overrides(demo, {"CDC__LAKE__ROOT": str(tmp_path / "lake")})
    urls = [spark.resolve_locations(spark.with_lake_metastore(c)["spark"]["settings"]) for c in (demo, other)]
    demo_db = f"{config.PROJECT_ROOT}/.stack/lake/_metastore/metastore_db"
    assert spark.derby_path(urls[0][spark.METASTORE_URL_KEY]) == demo_db
    assert spark.derby_path(urls[1][spark.METASTORE_URL_KEY]) == f"{tmp_path}/lake/_metastore/metastore_db"
    assert urls[1]["spark.sql.warehouse.dir"] == f"{tmp_path}/lake/warehouse"
    assert urls[1][spark.JAVA_OPTIONS_KEY] == f"-Dderby.system.home={tmp_path}/lake/_metastore"


def test_a_metastore_named_in_the_settings_wins_and_a_remote_lake_is_refused(tmp_path):
    own = spark.with_metastore(config.load("local"), str(tmp_path))
    assert spark.with_lake_metastore(own) is own
    remote = config.apply_overrides(config.load("local"), {"CDC__LAKE__ROOT": "abfss://lake@acct.dfs.core.windows.net/cdc"})
    with pytest.raises(config.ConfigError, match="spark.local_metastore: false"):
        spark.with_lake_metastore(remote)


def test_a_carried_function_runs_in_a_python_that_cannot_import_the_project(tmp_path):
    wrapped = spark.carrying(config.is_remote)
    (tmp_path / "function.pickle").write_bytes(cloudpickle.dumps(wrapped))
    # -S: no site-packages' .pth files, so neither the editable install of lib nor this checkout is on the path;
    # the site-packages folder itself is added back for pyspark (cloudpickle) and PyYAML
    script = textwrap.dedent(f"""
        import importlib.util, pickle, sys
        sys.path = [p for p in sys.path if p and not p.startswith({str(config.PROJECT_ROOT)!r})]
        sys.path.append({sysconfig.get_paths()["purelib"]!r})
        assert importlib.util.find_spec("lib") is None, "lib importable before the call"
        call = pickle.loads(open("function.pickle", "rb").read())
        print(call("s3://bucket/x"), call("/tmp/x"), sys.modules["lib"].__file__)
    """)
    done = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    remote, local, where = done.stdout.split()
    assert (remote, local) == ("True", "False")
    assert where == os.path.join(tempfile.gettempdir(), os.path.basename(spark.project_archive()), "lib",
                                 "__init__.py")
