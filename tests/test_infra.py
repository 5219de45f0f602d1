"""infra/ is correct by the tools that consume it.

- Prometheus: ``promtool check config``, ``promtool check rules`` and ``promtool test rules``
  pass, the rule tests include an alert that fires and one that stays silent, and promtool
  really compares (a wrong expectation fails). ``promtool`` comes with Debian's ``prometheus``
  package, which CI installs; without it these tests fail and say so instead of skipping.
- Every metric a rule, a rule test or the scrape config names is in the catalog, with the
  catalog's labels and the label values the exporter sets.
- The Ray cluster launcher configs validate against Ray's own cluster-config schema (and
  Ray's own checks that ``ray up`` runs before touching a cloud); their ``--labels`` parse
  with Ray's own parser.
- The KubeRay manifests carry the fields KubeRay's CRDs require (checked field by field: the
  CRDs' schemas are not vendored here) and the RayJob's entrypoint is a job spec that ringray
  accepts.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ringray.cluster.job_options import ClusterOptions
from ringray.metrics.catalog import (
    CATALOG,
    CONTROLLER_STATES,
    RESTART_REASONS,
    exported_series_names,
)
from ringray.spec import JobSpec, load_job_spec

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
PROMETHEUS = INFRA / "prometheus"
RAY_CONFIGS = {"aws-h100.yaml": "p5.48xlarge", "gcp-a3.yaml": "a3-highgpu-8g"}
# A metric name, but not a recording rule's output (level:metric:operation).
METRIC_NAME = re.compile(r"(?<![\w:])ringray_\w+(?![\w:])")


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is not installed: install Debian's prometheus package "
                    "(apt-get install -y prometheus), which provides it")
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def _assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{result.args}:\n{result.stdout}\n{result.stderr}"


def _rules() -> list[dict]:
    return [rule for group in _load(PROMETHEUS / "rules.yml")["groups"]
            for rule in group["rules"]]


def _catalog_labels(series: str) -> tuple[str, ...]:
    """The labels of an exported series name (a histogram's _bucket/_sum/_count included)."""
    for spec in CATALOG:
        if series == spec.name or (spec.kind == "histogram" and series.startswith(spec.name)):
            return spec.labels + (("le",) if series.endswith("_bucket") else ())
    raise AssertionError(f"{series} is not in ringray.metrics.catalog")


# ---------------------------------------------------------------- files
def test_every_infra_yaml_file_parses():
    """Every YAML file under infra/ parses to a mapping."""
    files = sorted([*INFRA.rglob("*.yml"), *INFRA.rglob("*.yaml")])
    assert len(files) >= 9, files
    for path in files:
        assert isinstance(_load(path), dict), path


# ---------------------------------------------------------------- promtool
def test_prometheus_config_passes_promtool():
    """The config (and the rule file it loads) passes ``promtool check config``."""
    _assert_ok(_promtool("check", "config", "infra/prometheus/prometheus.yml"))


def test_rules_pass_promtool():
    _assert_ok(_promtool("check", "rules", "infra/prometheus/rules.yml"))


def test_rule_unit_tests_pass_with_firing_and_silent_alerts():
    """``promtool test rules`` passes, and the tests expect alerts both to fire and not to."""
    _assert_ok(_promtool("test", "rules", "infra/prometheus/rules_test.yml"))
    cases = [case for test in _load(PROMETHEUS / "rules_test.yml")["tests"]
             for case in test.get("alert_rule_test", [])]
    firing = {case["alertname"] for case in cases if case["exp_alerts"]}
    silent = {case["alertname"] for case in cases if not case["exp_alerts"]}
    alerts = {rule["alert"] for rule in _rules() if "alert" in rule}
    assert firing == alerts, f"alerts with no firing test: {alerts - firing}"
    assert silent == alerts, f"alerts with no silent test: {alerts - silent}"


def test_promtool_rejects_a_wrong_expectation(tmp_path):
    """The rule tests are not vacuous: expecting silence where an alert fires fails."""
    shutil.copy(PROMETHEUS / "rules.yml", tmp_path / "rules.yml")
    tests = _load(PROMETHEUS / "rules_test.yml")
    case = next(case for test in tests["tests"] for case in test.get("alert_rule_test", [])
                if case["exp_alerts"])
    case["exp_alerts"] = []
    (tmp_path / "rules_test.yml").write_text(yaml.safe_dump(tests))
    result = _promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert result.returncode != 0, result.stdout
    assert case["alertname"] in result.stdout + result.stderr


# ---------------------------------------------------------------- names and labels
def test_rules_and_scrape_config_name_only_catalog_metrics():
    """Every ``ringray_*`` name in a rule's expression and in prometheus.yml is an exported
    series (recording rules' outputs, ``level:metric:operation``, excepted)."""
    exported = exported_series_names()
    texts = {"rules.yml": "\n".join(rule["expr"] for rule in _rules()),
             "prometheus.yml": (PROMETHEUS / "prometheus.yml").read_text()}
    named = {name: set(METRIC_NAME.findall(text)) for name, text in texts.items()}
    assert named["rules.yml"], "no metric found in rules.yml"
    for name, metrics in named.items():
        assert metrics <= exported, f"{name}: not in the catalog: {metrics - exported}"


def test_rules_use_the_exporters_labels_and_values():
    """Grouping and matching labels are catalog labels; state values are controller states."""
    labels = {label for spec in CATALOG for label in spec.labels} | {"le"}
    for rule in _rules():
        expr = rule["expr"]
        for group in re.findall(r"\b(?:by|on|without|ignoring)\s*\(([^)]*)\)", expr):
            used = {label.strip() for label in group.split(",") if label.strip()}
            assert used <= labels, f"{expr}: unknown labels {used - labels}"
        for op, value in re.findall(r'\bstate\s*(=~|=)\s*"([^"]*)"', expr):
            states = set(value.split("|")) if op == "=~" else {value}
            assert states <= set(CONTROLLER_STATES), f"{expr}: unknown states"


def test_rule_tests_feed_catalog_series_with_exporter_labels():
    """The rule tests' input series are what the exporter would serve: catalog names, the
    catalog's labels, states and restart reasons from the catalog."""
    tests = _load(PROMETHEUS / "rules_test.yml")["tests"]
    for test in tests:
        for series in test["input_series"]:
            match = re.fullmatch(r"(\w+)\{(.*)\}", series["series"].strip())
            assert match, series
            name, body = match.groups()
            pairs = dict(re.findall(r'(\w+)="([^"]*)"', body))
            assert set(pairs) == set(_catalog_labels(name)), series
            assert pairs.get("state", "running") in CONTROLLER_STATES, series
            assert pairs.get("reason", "hang") in RESTART_REASONS, series
    records = {rule["record"] for rule in _rules() if "record" in rule}
    tested = {case["expr"] for test in tests for case in test.get("promql_expr_test", [])}
    assert tested and tested <= records


# ---------------------------------------------------------------- scrape config, Grafana
def test_prometheus_scrapes_the_controller_and_ray():
    """The controller's default endpoint (the job spec's metrics port), keeping ringray's own
    ``job`` label, and Ray's nodes through Ray's service-discovery file."""
    config = _load(PROMETHEUS / "prometheus.yml")
    assert config["rule_files"] == ["rules.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    ringray = jobs["ringray"]
    assert ringray["honor_labels"] is True
    assert ringray["static_configs"][0]["targets"] == [f"localhost:{JobSpec().metrics.port}"]
    assert jobs["ray"]["file_sd_configs"] == [
        {"files": ["/tmp/ray/prom_metrics_service_discovery.json"]}
    ]


def test_grafana_provisioning_points_at_the_repositorys_dashboards():
    provisioning = INFRA / "grafana" / "provisioning"
    datasources = _load(provisioning / "datasources" / "prometheus.yml")
    assert datasources["apiVersion"] == 1
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://localhost:9090"
    dashboards = _load(provisioning / "dashboards" / "ringray.yml")
    (provider,) = dashboards["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"].replace("${RINGRAY_REPO}", str(REPO))
    assert Path(path) == REPO / "dashboards"


# ---------------------------------------------------------------- Ray cluster launcher
def _ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


@pytest.mark.parametrize("name", sorted(RAY_CONFIGS))
def test_ray_launcher_config_validates_against_rays_schema(name):
    """Ray's cluster-config schema, then what ``ray up`` checks before it touches a cloud
    (defaults filled in from the provider's, node types consistent)."""
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = _load(INFRA / "ray" / name)
    jsonschema.validate(config, _ray_schema())
    validate_config(prepare_config(copy.deepcopy(config)))


@pytest.mark.parametrize("name", sorted(RAY_CONFIGS))
def test_ray_launcher_config_autoscales_8_gpu_nodes(name):
    config = _load(INFRA / "ray" / name)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    (gpu,) = [t for t in types.values() if t["resources"].get("GPU")]
    assert gpu["resources"]["GPU"] == 8
    assert 0 <= gpu["min_workers"] < gpu["max_workers"] <= config["max_workers"]
    node = gpu["node_config"]
    assert node.get("InstanceType", node.get("machineType")) == RAY_CONFIGS[name]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    assert any("pip install -e ~/ringray" in cmd for cmd in config["setup_commands"])


@pytest.mark.parametrize("name", sorted(RAY_CONFIGS))
def test_ray_nodes_label_their_failure_domain(name):
    """Every ``ray start`` labels the node with the job spec's default failure domain; Ray's
    own parser accepts the labels; the head sets the GCS health-check knobs."""
    from ray._private.label_utils import parse_node_labels_string

    config = _load(INFRA / "ray" / name)
    domain = ClusterOptions().failure_domain
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [cmd for cmd in config[key] if "ray start" in cmd]
        argv = shlex.split(start.replace("$(cat ~/.ringray-zone)", "zone-a"))
        (labels,) = [arg.removeprefix("--labels=") for arg in argv
                     if arg.startswith("--labels=")]
        assert parse_node_labels_string(labels) == {domain: "zone-a"}
    head = " ".join(config["head_start_ray_commands"])
    assert "RAY_health_check_period_ms=" in head
    assert "RAY_health_check_failure_threshold=" in head


# ---------------------------------------------------------------- KubeRay
PORT_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?")  # a Kubernetes port name


def _check_pod_template(template: dict) -> dict:
    (container, *_) = template["spec"]["containers"]
    assert container["name"] and container["image"]
    for port in container.get("ports", []):
        assert PORT_NAME.fullmatch(port["name"]), port
    return container


def test_raycluster_autoscales_a_gpu_group():
    """What KubeRay's RayCluster CRD requires (a head template; each worker group's name and
    template; rayStartParams, required before KubeRay 1.4), and what ringray relies on: the
    in-tree autoscaler, a GPU group with room to grow, the metrics port on the head."""
    manifest = _load(INFRA / "kuberay" / "raycluster.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    assert manifest["metadata"]["name"]
    spec = manifest["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    container = _check_pod_template(head["template"])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["ringray-metrics"] == JobSpec().metrics.port
    assert {"gcs-server", "dashboard", "client"} <= set(ports)
    (group,) = spec["workerGroupSpecs"]
    assert group["groupName"] and isinstance(group["rayStartParams"], dict)
    assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    assert group["minReplicas"] < group["maxReplicas"]
    worker = _check_pod_template(group["template"])
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 8
    domain = ClusterOptions().failure_domain
    assert group["rayStartParams"]["labels"].startswith(f"{domain}=")


def test_rayjob_runs_ringray_train_on_the_same_cluster_spec():
    """The RayJob's cluster is raycluster.yaml's, and its entrypoint is ``ringray train`` on a
    job spec of this repository that ringray accepts with the entrypoint's overrides."""
    cluster = _load(INFRA / "kuberay" / "raycluster.yaml")
    manifest = _load(INFRA / "kuberay" / "rayjob.yaml")
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    assert spec["rayClusterSpec"] == cluster["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    argv = shlex.split(spec["entrypoint"])
    assert argv[:2] == ["ringray", "train"]
    assert argv[argv.index("--address") + 1] == "auto"
    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    job = load_job_spec(REPO / argv[2], overrides, check_paths=False)  # paths of the pod
    assert job.cluster.accelerator == "gpu"
    assert job.metrics.address == "0.0.0.0"
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/home/ray/ringray"
