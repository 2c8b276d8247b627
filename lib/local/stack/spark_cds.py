"""The local Spark driver's class-data archive: made once by `make install`, used by every local session.

Java's dynamic class-data sharing (CDS) writes the classes a JVM loaded, already parsed and verified,
to an archive when it exits (-XX:ArchiveClassesAtExit); a JVM started with -XX:SharedArchiveFile maps
them instead of loading them again. A driver that runs a small Delta workload once leaves the archive;
lib/spark.py passes it to every later local driver (measured in docs/testing.md).
`python -m lib.local.stack.spark_cds <archive>` is that one run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lib import config
from lib import spark as spark_session
from lib.local.stack.process import StackError


def archive_path(conf: dict) -> Path | None:
    """Where the archive of this Java and pyspark goes (None when conf names no spark.class_archive_dir)."""
    folder = config.get(conf, "spark.class_archive_dir")
    return Path(spark_session.class_archive(config.location(folder))) if folder else None


def ensure(conf: dict, log=print) -> Path | None:
    """Make the archive unless it exists; its path."""
    target = archive_path(conf)
    if target is None or target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"spark     writing the driver's class-data archive {target.name} (once, about 30 s)")
    staging = Path(tempfile.mkdtemp(prefix="cds.", dir=target.parent))
    partial = staging / target.name
    env = {**os.environ, "CDC__SPARK__CLASS_ARCHIVE_DIR": "",
           "CDC__SPARK__DRIVER_JAVA_OPTIONS": f"-XX:ArchiveClassesAtExit={partial} -Xlog:cds=off -Xlog:cds+dynamic=off"}
    result = subprocess.run([sys.executable, "-m", "lib.local.stack.spark_cds", str(staging)], env=env,
                            cwd=config.PROJECT_ROOT, capture_output=True, text=True, timeout=600)
    try:
        if result.returncode != 0 or not partial.is_file():
            raise StackError(f"the Spark driver's class-data archive could not be written (exit {result.returncode}); "
                             f"Spark still works without it, only starts slower. Run `make install` again to retry",
                             details=(result.stdout + result.stderr)[-3000:])
        partial.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def warm_up(folder: str) -> None:
    """A driver that loads what notebooks and the merge load: the Hive catalog, Delta writes, a MERGE, Avro."""
    conf = spark_session.with_metastore(config.load("local"), os.path.join(folder, "metastore"))
    spark = spark_session.from_conf(conf)
    path = os.path.join(folder, "table")
    spark.sql("SHOW DATABASES").collect()
    spark.range(100).selectExpr("id", "cast(id AS string) AS name").write.format("delta").save(path)
    spark.range(50, 150).selectExpr("id", "'x' AS name").createOrReplaceTempView("changes")
    spark.sql(f"MERGE INTO delta.`{path}` t USING changes c ON t.id = c.id WHEN MATCHED THEN UPDATE SET * "
              f"WHEN NOT MATCHED THEN INSERT *")
    spark.read.format("delta").load(path).groupBy("name").count().collect()
    spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    spark.stop()


if __name__ == "__main__":
    warm_up(sys.argv[1])
