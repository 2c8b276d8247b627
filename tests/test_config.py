"""Conf loading, environment overrides and secret resolution (no services needed)."""

from __future__ import annotations

import ast

import pytest

from lib import config, secrets


@pytest.fixture
def conf_dir(tmp_path):
    (tmp_path / "dev.yml").write_text(
        "kafka:\n  bootstrap_servers: a:1\n  partitions: 3\n"
        "source:\n  password: {env: DEV_PG_PASSWORD}\n  vault: {scope: cdc, key: pg}\n"
    )
    return tmp_path


def test_local_conf_loads_with_every_section():
    conf = config.load("local", environ={})
    assert conf["target"] == "local"
    for section in ("source", "kafka", "registry", "spark", "lake", "stack"):
        assert isinstance(conf[section], dict), section
    assert secrets.is_reference(conf["source"]["password"])


def test_env_override_replaces_nested_value_with_yaml_type(conf_dir):
    environ = {"CDC__KAFKA__PARTITIONS": "6", "CDC__KAFKA__BOOTSTRAP_SERVERS": "broker:9092",
               "CDC__SPARK__SETTINGS__SPARK.UI.ENABLED": "true", "UNRELATED": "x"}
    conf = config.load("dev", conf_dir, environ)
    assert conf["kafka"] == {"bootstrap_servers": "broker:9092", "partitions": 6}
    assert conf["spark"]["settings"]["spark.ui.enabled"] is True


def test_env_target_picks_the_file(conf_dir):
    assert config.load(None, conf_dir, {"CDC_TARGET": "dev"})["target"] == "dev"


def test_override_into_a_value_is_an_error_naming_it(conf_dir):
    with pytest.raises(config.ConfigError, match=r"CDC__KAFKA__PARTITIONS__X: kafka.partitions is a value"):
        config.load("dev", conf_dir, {"CDC__KAFKA__PARTITIONS__X": "1"})


def test_unknown_target_lists_the_known_ones(conf_dir):
    with pytest.raises(config.ConfigError, match=r"target 'prod'.*known targets: dev"):
        config.load("prod", conf_dir, {})


def test_extends_starts_from_another_target_and_replaces_what_it_names(conf_dir):
    (conf_dir / "edge.yml").write_text("extends: dev\nkafka:\n  partitions: 1\n  topics: [a]\nlake: {root: /x}\n")
    conf = config.load("edge", conf_dir, {"CDC__KAFKA__BOOTSTRAP_SERVERS": "b:2"})
    assert conf["kafka"] == {"bootstrap_servers": "b:2", "partitions": 1, "topics": ["a"]}
    assert conf["source"]["vault"] == {"scope": "cdc", "key": "pg"} and conf["lake"] == {"root": "/x"}
    assert "extends" not in conf and conf["target"] == "edge"


def test_extends_in_a_circle_or_to_a_missing_target_is_an_error(conf_dir):
    (conf_dir / "a.yml").write_text("extends: b\n")
    (conf_dir / "b.yml").write_text("extends: a\n")
    with pytest.raises(config.ConfigError, match=r"goes round in a circle \(a -> b -> a\)"):
        config.load("a", conf_dir, {})
    (conf_dir / "c.yml").write_text("extends: gone\n")
    with pytest.raises(config.ConfigError, match=r"c.yml extends 'gone', but .*gone.yml does not exist"):
        config.load("c", conf_dir, {})


def test_the_cluster_and_connect_targets_are_local_with_their_own_spark_and_names():
    local, cluster, connect = (config.load(t, environ={}) for t in ("local", "cluster", "connect"))
    assert cluster["source"]["tables"] == local["source"]["tables"] == connect["source"]["tables"]
    assert cluster["spark"]["settings"]["spark.master"].startswith("spark://")
    assert connect["spark"]["remote"].startswith("sc://")
    names = {(c["source"]["slot"], c["kafka"]["topic_prefix"], c["lake"]["root"]) for c in (local, cluster, connect)}
    assert len(names) == 3  # each target its own slot, topics and lake: all three can run at once


def test_invalid_yaml_names_the_file(tmp_path):
    (tmp_path / "bad.yml").write_text("kafka: [unclosed\n")
    with pytest.raises(config.ConfigError, match=r"bad.yml is not valid YAML"):
        config.load("bad", tmp_path, {})


def test_missing_setting_names_path_file_and_override(conf_dir):
    conf = config.load("dev", conf_dir, {})
    assert config.get(conf, "kafka.partitions") == 3
    assert config.get(conf, "kafka.nothing", None) is None
    with pytest.raises(config.ConfigError, match=r"registry.url is missing in .*dev.yml.*CDC__REGISTRY__URL"):
        config.get(conf, "registry.url")


def test_secret_from_environment_first(conf_dir, tmp_path):
    conf = config.load("dev", conf_dir, {})
    file = tmp_path / "secrets.env"
    file.write_text("DEV_PG_PASSWORD=from-file\n")
    file.chmod(0o600)
    ref = conf["source"]["password"]
    assert secrets.resolve(ref, environ={"DEV_PG_PASSWORD": "from-env"}, secrets_file=file) == "from-env"
    assert secrets.resolve(ref, environ={}, secrets_file=file) == "from-file"


def test_missing_secret_names_reference_setting_and_places_looked(conf_dir, tmp_path):
    conf = config.load("dev", conf_dir, {})
    file = tmp_path / "secrets.env"
    with pytest.raises(secrets.SecretError) as error:
        secrets.setting(conf, "source.password", environ={}, secrets_file=file)
    message = str(error.value)
    assert "source.password" in message and "dev.yml" in message
    assert "environment variable DEV_PG_PASSWORD" in message and str(file) in message


def test_literal_secret_in_conf_is_refused():
    with pytest.raises(secrets.SecretError, match=r"source.password must be a secret reference"):
        secrets.resolve("hunter2hunter2", setting="source.password", environ={})


def test_databricks_reference_needs_databricks(conf_dir):
    conf = config.load("dev", conf_dir, {})
    with pytest.raises(secrets.SecretError, match=r"databricks secret cdc/pg.*only resolves on Databricks"):
        secrets.setting(conf, "source.vault", environ={})


class SecretScopes:
    """The shape of dbutils.secrets: get(scope, key) from a dict, KeyError otherwise."""

    def __init__(self, values):
        self.values = values

    def get(self, scope, key):
        return self.values[(scope, key)]


class DbUtils:
    def __init__(self, values):
        self.secrets = SecretScopes(values)


def test_databricks_reference_resolves_through_dbutils(conf_dir):
    conf = config.load("dev", conf_dir, {})
    found = secrets.setting(conf, "source.vault", dbutils=DbUtils({("cdc", "pg"): "s3cret"}))
    assert found == "s3cret"
    with pytest.raises(secrets.SecretError, match=r"databricks secret cdc/pg could not be read.*put-secret cdc pg"):
        secrets.setting(conf, "source.vault", dbutils=DbUtils({}))


def test_describe_never_shows_a_value():
    assert secrets.describe({"env": "X"}) == "env:X"
    assert secrets.describe({"scope": "s", "key": "k"}) == "databricks secret s/k"


def test_override_keeps_the_case_of_an_existing_key(tmp_path):
    (tmp_path / "t.yml").write_text("spark:\n  settings:\n    spark.sql.catalogImplementation: in-memory\n")
    conf = config.load("t", tmp_path, {"CDC__SPARK__SETTINGS__SPARK.SQL.CATALOGIMPLEMENTATION": "hive"})
    assert conf["spark"]["settings"] == {"spark.sql.catalogImplementation": "hive"}


def test_a_secrets_file_others_may_read_is_refused_naming_it_and_the_remedy(conf_dir, tmp_path):
    conf = config.load("dev", conf_dir, {})
    file = tmp_path / "secrets.env"
    file.write_text("DEV_PG_PASSWORD=from-file\n")
    file.chmod(0o644)
    with pytest.raises(secrets.SecretError) as error:
        secrets.setting(conf, "source.password", environ={}, secrets_file=file)
    assert str(error.value) == (f"{file} holds secrets but its permissions are 644 (group or others may read or "
                                f"change it); run chmod 600 {file} and try again")
    assert "from-file" not in str(error.value)
    file.chmod(0o600)
    assert secrets.setting(conf, "source.password", environ={}, secrets_file=file) == "from-file"


def test_a_setting_conf_leaves_out_has_its_one_default(conf_dir):
    conf = config.load("dev", conf_dir, {})
    assert config.get(conf, "merge.parallelism") == 4
    first = config.get(conf, "merge.kafka_options")
    first["mutated"] = "yes"
    assert config.get(conf, "merge.kafka_options") == {}  # every caller gets a fresh copy
    with pytest.raises(config.ConfigError, match="setting merge.not_a_setting is missing"):
        config.get(conf, "merge.not_a_setting")


def test_no_module_repeats_a_default_that_config_holds():
    """config.get(conf, key, default) for a key in config.DEFAULTS: a second default that could drift."""
    repeated = []
    for path in (config.PROJECT_ROOT / "lib").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "config"
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in config.DEFAULTS):
                repeated.append(f"{path.name}:{node.lineno} {node.args[1].value}")
    assert repeated == []
