"""SparkSession for the pipeline: Databricks' own session, or a local one with Delta, Kafka and Avro."""
import glob
import os

from pyspark.sql import SparkSession

from lib import config


def local_jars(jars_dir: str) -> list[str]:
    """Sorted jar paths in jars_dir (filled from lib/stack/poms/spark.xml, which already leaves out pyspark's jars)."""
    return sorted(glob.glob(os.path.join(jars_dir, "*.jar")))


def session(app_name: str, jars_dir: str | None = None, settings: dict[str, str] | None = None) -> SparkSession:
    """Databricks' session unchanged, else a local[*] session with Delta, Kafka and Avro jars from jars_dir."""
    if os.environ.get("DATABRICKS_RUNTIME_VERSION"):
        return SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
    jars = local_jars(jars_dir) if jars_dir else []
    if not jars:
        raise RuntimeError(f"no Spark jars in {jars_dir or '(no jars_dir given)'}: run `make install` to fetch them")
    conf = {
        "spark.master": "local[*]",
        "spark.app.name": app_name,
        "spark.jars": ",".join(jars),
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.shuffle.partitions": "4",
        "spark.databricks.delta.snapshotPartitions": "4",
        "spark.ui.enabled": "false",
        **(settings or {}),
    }
    builder = SparkSession.builder
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def from_conf(conf: dict) -> SparkSession:
    """The session a target's conf describes (spark.app_name, spark.jars_dir, spark.settings)."""
    settings = dict(config.get(conf, "spark.settings", {}) or {})
    if "spark.sql.warehouse.dir" in settings:
        settings["spark.sql.warehouse.dir"] = config.location(settings["spark.sql.warehouse.dir"])
    jars_dir = config.get(conf, "spark.jars_dir", None)
    return session(config.get(conf, "spark.app_name", "cdc-pipeline"),
                   config.location(jars_dir) if jars_dir else None, {k: str(v) for k, v in settings.items()})
