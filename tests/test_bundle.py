"""bundle.yml validated offline: Databricks' own job models (databricks-bundles), the notebooks it names,
the 01 -> 05 chain, the notebooks' parameters, libraries pinned as in requirements.txt, the continuous jobs'
entry point, per-target conf, and no literal secret.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml
from databricks.bundles.jobs import Job

from lib import config, runtime, secrets
from lib.operate import metrics, notebook_task, service

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = yaml.safe_load((ROOT / "bundle.yml").read_text())
TEXT = (ROOT / "bundle.yml").read_text()
CHAIN = [("bootstrap_slot", "01_bootstrap_slot"), ("snapshot", "02_snapshot"),
         ("stream_to_kafka", "03_stream_to_kafka"), ("merge_into_delta", "04_merge_into_delta"),
         ("masking_views", "05_masking_views")]
KNOWN_TOP = {"bundle", "artifacts", "variables", "resources", "targets", "include", "workspace", "sync", "permissions",
             "run_as", "presets", "experimental", "scripts"}
BUILTIN = {"bundle.target", "bundle.name", "bundle.git.commit", "bundle.git.branch", "workspace.file_path",
           "workspace.root_path", "workspace.current_user.userName"}
REFERENCE = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def jobs() -> dict:
    return BUNDLE["resources"]["jobs"]


def tasks(job: dict) -> list[dict]:
    return job.get("tasks") or []


def variables(target: str) -> dict:
    values = {name: spec.get("default") for name, spec in BUNDLE["variables"].items()}
    values.update((BUNDLE["targets"][target] or {}).get("variables") or {})
    return values


def resolve(node, values: dict):
    """${var.x} replaced by the target's value (a whole-string reference keeps the value's type)."""
    if isinstance(node, dict):
        return {k: resolve(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, values) for v in node]
    if isinstance(node, str):
        whole = REFERENCE.fullmatch(node)
        if whole and whole.group(1).startswith("var."):
            return values[whole.group(1)[4:]]
        return REFERENCE.sub(lambda m: str(values[m.group(1)[4:]]) if m.group(1).startswith("var.") else m.group(0),
                             node)
    return node


def notebook_parameters(path: Path) -> dict:
    """Names and literal defaults of the notebook's cell tagged 'parameters'."""
    cells = [c for c in json.loads(path.read_text())["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"{path.name}: exactly one cell tagged 'parameters' expected, found {len(cells)}"
    found = {}
    for node in ast.parse("".join(cells[0]["source"])).body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name), \
            f"{path.name}: the parameters cell holds only `name = literal` lines"
        found[node.targets[0].id] = ast.literal_eval(node.value)  # a default every run can fall back on
    return found


def requirement_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            pins[re.split(r"[\[=<>]", line)[0].lower()] = line
    return pins


def test_top_level_and_targets():
    assert set(BUNDLE) <= KNOWN_TOP, set(BUNDLE) - KNOWN_TOP
    assert not (ROOT / "databricks.yml").exists(), "the CLI refuses a folder with both bundle.yml and databricks.yml"
    assert BUNDLE["bundle"]["name"]
    assert set(BUNDLE["targets"]) == {"dev", "prod"}
    assert [name for name, t in BUNDLE["targets"].items() if t.get("default")] == ["dev"]
    assert BUNDLE["targets"]["dev"]["mode"] == "development" and BUNDLE["targets"]["prod"]["mode"] == "production"


def test_every_reference_is_defined():
    for name in REFERENCE.findall(TEXT):
        if name.startswith("var."):
            assert name[4:] in BUNDLE["variables"], f"${{{name}}} is used but not declared under variables"
        else:
            assert name in BUILTIN, f"${{{name}}} is not a bundle substitution this test knows"
    for target in BUNDLE["targets"]:
        unknown = set((BUNDLE["targets"][target] or {}).get("variables") or {}) - set(BUNDLE["variables"])
        assert not unknown, f"target {target} sets undeclared variables {unknown}"


@pytest.mark.parametrize("target", ["dev", "prod"])
def test_jobs_build_as_databricks_models(target):
    for name, job in jobs().items():
        Job.from_dict(job)  # with ${var...} left in place, as the CLI sees it before substitution
        built = Job.from_dict(resolve(job, variables(target)))
        assert built.name and built.tasks, name
        for cluster in built.job_clusters:
            assert isinstance(cluster.new_cluster.num_workers, int), (name, cluster.job_cluster_key)


@pytest.mark.parametrize("target", ["dev", "prod"])
def test_each_target_picks_an_existing_conf(target):
    chosen = variables(target)["conf_target"]
    assert (ROOT / "conf" / f"{chosen}.yml").is_file(), f"target {target}: conf/{chosen}.yml does not exist"
    conf = config.load(chosen, conf_dir=ROOT / "conf", environ={})
    assert conf["source"]["tables"] and config.get(conf, "monitor.warn_retained_wal_bytes") > 0


def test_every_cluster_finds_the_synced_conf():
    for name, job in jobs().items():
        for cluster in job.get("job_clusters") or []:
            env = cluster["new_cluster"]["spark_env_vars"]
            assert env["CDC_CONF_DIR"] == "/Workspace${workspace.file_path}/conf", (name, env)
            assert env["CDC_TARGET"] == "${var.conf_target}", (name, env)


def test_notebook_job_chains_01_to_05_in_order():
    job = jobs()["cdc_notebooks"]
    steps = tasks(job)
    assert [t["task_key"] for t in steps] == [key for key, _ in CHAIN]
    for i, (step, (_, stem)) in enumerate(zip(steps, CHAIN, strict=True)):
        path = ROOT / step["notebook_task"]["notebook_path"]
        assert path.name == f"{stem}.ipynb"
        assert path.is_file(), f"task {step['task_key']}: {path.relative_to(ROOT)} does not exist"
        wanted = [] if i == 0 else [{"task_key": steps[i - 1]["task_key"]}]
        assert step.get("depends_on", []) == wanted, step["task_key"]
        assert step["job_cluster_key"] in {c["job_cluster_key"] for c in job["job_clusters"]}


def test_every_notebook_parameter_gets_a_value_or_a_default():
    for step in tasks(jobs()["cdc_notebooks"]):
        path = ROOT / step["notebook_task"]["notebook_path"]
        if not path.is_file():
            pytest.fail(f"{path.relative_to(ROOT)} (task {step['task_key']}) does not exist")
        defaults = notebook_parameters(path)
        given = step["notebook_task"].get("base_parameters") or {}
        assert given.get("target") == "${var.conf_target}", f"{path.name}: target must come from the bundle target"
        unknown = set(given) - set(defaults)
        assert not unknown, f"{path.name}: base_parameters {unknown} are not in its parameters cell"
        for name, value in given.items():  # a value arrives as a widget's text: it must parse as the default's type
            if "${" not in str(value):
                runtime.convert(str(value), defaults[name])


def test_the_wheel_is_pure_python():
    # the compiled capture (setup.py) would tie the wheel to one Python and platform; clusters take the Python path
    for artifact in BUNDLE["artifacts"].values():
        assert artifact["build"].startswith("CDC_PURE_PYTHON=1 "), artifact["build"]


def test_libraries_are_the_wheel_and_pinned_pypi_packages():
    pins = requirement_pins()
    needed = {re.split(r"[\[=<>]", d)[0].lower() for d in
              tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    for name, job in jobs().items():
        for step in [t for t in tasks(job) if "job_cluster_key" in t]:  # serverless: the job's environment, below
            libraries = step.get("libraries") or []
            assert {"whl": "./dist/*.whl"} in libraries, (name, step["task_key"])
            pypi = [lib["pypi"]["package"] for lib in libraries if "pypi" in lib]
            for package in pypi:
                base = re.split(r"[\[=<>]", package)[0].lower()
                assert pins.get(base) == package, f"{package} is not pinned like that in requirements.txt"
            bases = {re.split(r"[\[=<>]", p)[0].lower() for p in pypi}
            assert not bases & {"pyspark", "delta-spark"}, "the Databricks runtime brings pyspark and Delta"
            assert needed <= bases, f"{name}/{step['task_key']} lacks {needed - bases}"
    assert "databricks-bundles" in pins


def test_continuous_jobs_run_the_service_entry_point():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    continuous = {name: job for name, job in jobs().items() if "continuous" in job}
    assert variables("prod")["continuous_pause"] == "UNPAUSED" and variables("dev")["continuous_pause"] == "PAUSED"
    started = set()
    for name, job in continuous.items():
        assert job["continuous"]["pause_status"] == "${var.continuous_pause}", name
        assert job.get("max_concurrent_runs") == 1, name
        (step,) = tasks(job)
        wheel = step["python_wheel_task"]
        assert wheel["package_name"] == project["name"].replace("-", "_")
        module, _, function = project["scripts"][wheel["entry_point"]].partition(":")
        assert (module, function) == ("lib.operate.service", "main")
        args = service.parser().parse_args(wheel["parameters"])
        assert args.command == "run" and args.run_target == "${var.conf_target}"
        started.add(args.service)
    assert started == set(metrics.SERVICES)


def test_no_literal_secret():
    sensitive = re.compile(r"pass(word)?|secret|token|credential|salt|private", re.IGNORECASE)

    def walk(node, where=""):
        if isinstance(node, dict):
            for key, value in node.items():
                if sensitive.search(str(key)) and not isinstance(value, (dict, list)):
                    assert re.fullmatch(r"\{\{secrets/[^/]+/[^}]+\}\}|\$\{var\.[a-z_]+\}", str(value)), \
                        f"{where}.{key} holds a literal value; use a secret scope reference"
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    walk(BUNDLE)
    for value in secrets.read_env_file(secrets.env_file()).values():
        assert not value or value not in TEXT, "a local secret value appears in bundle.yml"
    conf = config.load("databricks", conf_dir=ROOT / "conf", environ={})
    for dotted in ("source.password", "source.admin_password", "masking.salt", "kafka.sasl_password"):
        ref = config.get(conf, dotted)
        assert secrets.is_reference(ref) and "scope" in ref, f"conf/databricks.yml {dotted} must be {{scope, key}}"


def test_the_serverless_job_runs_the_same_notebooks_01_to_05_as_wheel_tasks():
    job = jobs()["cdc_notebooks_serverless"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not job.get("job_clusters") and "continuous" not in job
    environments = {e["environment_key"] for e in job["environments"]}
    steps = tasks(job)
    assert [t["task_key"] for t in steps] == [key for key, _ in CHAIN]
    for i, (step, (_, stem)) in enumerate(zip(steps, CHAIN, strict=True)):
        assert "job_cluster_key" not in step and "new_cluster" not in step and not step.get("libraries")
        assert step["environment_key"] in environments, step["task_key"]
        wanted = [] if i == 0 else [{"task_key": steps[i - 1]["task_key"]}]
        assert step.get("depends_on", []) == wanted, step["task_key"]
        wheel = step["python_wheel_task"]
        assert wheel["package_name"] == project["name"].replace("-", "_")
        assert project["scripts"][wheel["entry_point"]] == "lib.operate.notebook_task:main"
        args = notebook_task.parser().parse_args(wheel["parameters"])
        assert args.conf_dir == "/Workspace${workspace.file_path}/conf"
        assert args.notebook == f"/Workspace${{workspace.file_path}}/notebooks/{stem}.ipynb"
        defaults = notebook_parameters(ROOT / "notebooks" / f"{stem}.ipynb")
        given = dict(item.split("=", 1) for item in args.param)
        assert given.get("target") == "${var.serverless_conf_target}", stem
        assert set(given) <= set(defaults), f"{stem}: {set(given) - set(defaults)} not in its parameters cell"
        for name, value in given.items():  # each arrives as text and must parse as the default's type
            if "${" not in value:
                runtime.convert(value, defaults[name])
        if stem == "04_merge_into_delta":  # serverless streams with availableNow triggers only
            assert runtime.convert(given["continuous"], True) is False


def test_the_serverless_environment_is_the_wheel_and_the_pinned_pypi_packages():
    pins = requirement_pins()
    needed = {re.split(r"[\[=<>]", d)[0].lower() for d in
              tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    cluster_pypi = [lib["pypi"]["package"] for lib in tasks(jobs()["cdc_notebooks"])[0]["libraries"] if "pypi" in lib]
    (environment,) = jobs()["cdc_notebooks_serverless"]["environments"]
    wheel, *pypi = environment["spec"]["dependencies"]
    assert wheel == "./dist/*.whl" and pypi == cluster_pypi  # the same libraries as on the job cluster
    for package in pypi:
        assert pins.get(re.split(r"[\[=<>]", package)[0].lower()) == package, f"{package} is not pinned so"
    assert needed <= {re.split(r"[\[=<>]", p)[0].lower() for p in pypi}
    assert str(variables("prod")["serverless_environment_version"]).isdigit()


def test_the_serverless_conf_extends_databricks_with_the_copy_reader():
    chosen = variables("prod")["serverless_conf_target"]
    conf = config.load(chosen, conf_dir=ROOT / "conf", environ={})
    base = config.load("databricks", conf_dir=ROOT / "conf", environ={})
    assert config.get(conf, "snapshot.reader") == "copy" and config.get(base, "snapshot.reader") == "jdbc"
    assert conf["source"]["tables"] == base["source"]["tables"] and conf["kafka"] == base["kafka"]


def test_the_continuous_merge_stays_on_a_cluster_and_says_why():
    assert jobs()["cdc_merge"]["job_clusters"]
    comment = TEXT[:TEXT.index("    cdc_merge:")].rsplit("\n\n", 1)[-1]
    assert "availableNow" in comment and "processing-time" in comment
