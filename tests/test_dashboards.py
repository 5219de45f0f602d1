"""The Grafana dashboards: their structure, the committed JSON, their queries, export and push.

The dashboards are built with Grafana's foundation SDK; these tests read the JSON it wrote,
so they hold for whatever builds it.

Structure contracts: stable unique uids, unique panel ids, a ``datasource`` variable used by
every panel and query, every query filtered by the ``job`` variable, panels inside the
24-column grid without overlaps, and every metric a panel queries in the metric catalog.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from grafana_foundation_sdk.builders import dashboard as sdk_dashboard
from typer.testing import CliRunner

from ringray.cli import app
from ringray.dashboards import dashboards, panel_queries, render
from ringray.dashboards.panels import place, thresholds, timeseries_panel
from ringray.dashboards.push import DashboardPushError, push_dashboards
from ringray.metrics.catalog import (
    CATALOG,
    CONTROLLER_STATES,
    RESTART_REASONS,
    exported_series_names,
)

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "dashboards"
FILES = ("ringray-job.json", "ringray-ring.json")
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
METRIC_NAME = re.compile(r"ringray_[a-z0-9_]+")
# A metric's selector: its name and, when present, its label matchers.
SELECTOR = re.compile(r"(ringray_[a-z0-9_]+)(\{[^}]*\})?")


def _load(name: str) -> dict:
    return json.loads((COMMITTED / name).read_text(encoding="utf-8"))


@pytest.fixture(params=FILES)
def board(request) -> dict:
    return _load(request.param)


def _targets(board: dict) -> list[tuple[dict, dict]]:
    return [(panel, target) for panel in board["panels"] for target in panel["targets"]]


def test_the_committed_json_is_a_fresh_build():
    """dashboards/*.json are exactly what the code builds: nobody edited them by hand, and
    nobody changed the code without regenerating them (python dashboards/build.py)."""
    built = dashboards()
    assert sorted(built) == sorted(FILES)
    for name, dashboard in built.items():
        assert (COMMITTED / name).read_text(encoding="utf-8") == render(dashboard), name


def test_the_build_script_regenerates_the_files_byte_identically(tmp_path):
    subprocess.run([sys.executable, str(COMMITTED / "build.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (COMMITTED / name).read_bytes(), name


def test_uids_are_stable_and_unique():
    boards = [_load(name) for name in FILES]
    assert [b["uid"] for b in boards] == ["ringray-job", "ringray-ring"]
    assert [b["title"] for b in boards] == ["ringray / Job", "ringray / Ring"]
    for b in boards:
        # Grafana assigns ids; a fixed one would clash on import (the SDK leaves it out).
        assert b.get("id") is None
        assert b["schemaVersion"] >= 39


def test_panel_ids_are_unique(board):
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))


def test_the_variables_are_a_prometheus_datasource_and_the_job(board):
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"datasource", "job"}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query"
    assert job["query"] == "label_values(ringray_training_step, job)"
    assert job["datasource"] == DATASOURCE


def test_every_panel_and_query_uses_the_datasource_variable(board):
    for panel in board["panels"]:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
    for panel, target in _targets(board):
        assert target["datasource"] == DATASOURCE, panel["title"]


def test_every_metric_selector_filters_by_the_job_variable(board):
    for panel, target in _targets(board):
        selectors = SELECTOR.findall(target["expr"])
        assert selectors, (panel["title"], target["expr"])
        for name, matchers in selectors:
            assert 'job="$job"' in matchers, (panel["title"], name, target["expr"])


def test_panels_lie_inside_the_grid_and_do_not_overlap(board):
    cells: dict[tuple[int, int], str] = {}
    for panel in board["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["y"] >= 0 and pos["w"] >= 1 and pos["h"] >= 1
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[x, y]!r}"
                cells[x, y] = panel["title"]


def test_every_queried_metric_is_in_the_catalog(board):
    exported = exported_series_names()
    for panel, target in _targets(board):
        for name in METRIC_NAME.findall(target["expr"]):
            assert name in exported, (panel["title"], name)


def test_every_catalog_metric_is_on_a_dashboard():
    """A metric nobody can see is a metric nobody watches: each one has a panel."""
    queried = {name for file in FILES for _, target in _targets(_load(file))
               for name in METRIC_NAME.findall(target["expr"])}
    for spec in CATALOG:
        names = ({f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count"}
                 if spec.kind == "histogram" else {spec.name})
        assert names & queried, spec.name


def test_the_dashboards_answer_the_issue_questions():
    titles = {file: [p["title"] for p in _load(file)["panels"]] for file in FILES}
    job, ring = titles["ringray-job.json"], titles["ringray-ring.json"]
    for title in ("State", "Throughput", "Model FLOPs utilisation", "Loss", "Step time",
                  "Checkpoint duration", "Last checkpoint", "Restarts by reason",
                  "Recovery time", "World size vs target"):
        assert title in job
    for title in ("Overlap per ring", "Load imbalance per ring",
                  "Exposed communication per rank", "Ring bytes sent per rank",
                  "Slowest rank ÷ median", "Peak memory per rank",
                  "All-to-all seconds per rank", "Peer wait per rank",
                  "Exposed wait split per ring"):
        assert title in ring
    heatmap = next(p for p in _load("ringray-ring.json")["panels"]
                   if p["title"] == "Exposed communication per rank")
    assert heatmap["type"] == "heatmap"


def test_the_catalogs_label_values_reach_the_dashboards():
    """The restart reasons a description lists and the states the state panels colour are
    the catalog's, so a reason or state added there shows up here on the next build."""
    job = {p["title"]: p for p in _load("ringray-job.json")["panels"]}
    for reason in RESTART_REASONS:
        assert reason in job["Restarts by reason"]["description"], reason
    for title in ("State", "State over time"):
        colored = [o["matcher"]["options"] for o in job[title]["fieldConfig"]["overrides"]]
        assert colored == list(CONTROLLER_STATES), title


def test_a_row_wider_than_the_grid_is_refused():
    row = [timeseries_panel("left", 12), timeseries_panel("right", 13)]
    with pytest.raises(ValueError, match=r"\['left', 'right'\] is 12 \+ 13 = 25 columns"):
        place(sdk_dashboard.Dashboard("t"), [row])
    with pytest.raises(ValueError, match="width 25 must be 1..24"):
        timeseries_panel("wide", 25)
    with pytest.raises(ValueError, match="the first step is the base"):
        thresholds((1, "red"))


def test_panel_queries_substitutes_the_variables():
    board = _load("ringray-ring.json")
    queries = panel_queries(board, job="train-7", rate_interval="2m")
    assert len(queries) == len(_targets(board))
    for title, expr in queries:
        assert "$" not in expr, (title, expr)
        assert 'job="train-7"' in expr and 'job="$job"' not in expr
    traffic = dict(queries)["Ring bytes sent per rank"]
    assert traffic == 'rate(ringray_ring_sent_bytes_total{job="train-7"}[2m])'
    # A job name is a PromQL string literal once substituted.
    (_, expr), *_ = panel_queries(board, job='a"b\\c')
    assert 'job="a\\"b\\\\c"' in expr


def test_panel_queries_names_an_unknown_variable():
    board = {"panels": [{"title": "p", "targets": [{"expr": 'up{instance="$host"}'}]}]}
    with pytest.raises(ValueError, match=r"panel 'p'.*\$host"):
        panel_queries(board, job="j")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_every_substituted_query_is_valid_promql(tmp_path):
    """promtool parses each expression (as a recording rule); running them against a real
    Prometheus that scraped a training run is the end-to-end test's job."""
    queries = [expr for file in FILES for _, expr in panel_queries(_load(file), job="j")]
    rules = {"groups": [{"name": "dashboards", "rules": [
        {"record": f"ringray:dashboard_query_{i}", "expr": expr}
        for i, expr in enumerate(queries)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rules))  # JSON is YAML
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cli_export_writes_the_committed_files(tmp_path):
    out = tmp_path / "exported"
    result = CliRunner().invoke(app, ["dashboards", "export", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    for name in FILES:
        assert (out / name).read_bytes() == (COMMITTED / name).read_bytes()


def test_cli_export_into_a_file_is_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["dashboards", "export", str(blocker / "sub")])
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output
    # Each said only "File exists" / "Is a directory", or (empty) wrote into the current
    # directory, before.
    (tmp_path / "d" / "ringray-job.json").mkdir(parents=True)
    for target, message in ((str(blocker), f"error: DIR: '{blocker}' is a file; give a "
                                           f"directory"),
                            ("", "error: DIR: empty; give the directory"),
                            (str(tmp_path / "d"), "ringray-job.json: Is a directory; give a "
                                                  "directory where the dashboards' JSON")):
        result = CliRunner().invoke(app, ["dashboards", "export", target])
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.output.split()), result.output


# ---- push: a fake Grafana on loopback ------------------------------------------------------

TOKEN = "glsa_test_token"
UID = re.compile(r"^[a-zA-Z0-9\-_]{1,40}$")  # Grafana's rule for dashboard and folder uids


class FakeGrafana(ThreadingHTTPServer):
    """The part of Grafana's HTTP API that ``ringray dashboards push`` uses, answering as
    Grafana does (status codes and JSON bodies from its API reference), and a log of every
    request so that a test can check the contract."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _GrafanaHandler)
        self.requests: list[tuple[str, str, dict]] = []  # method, path, JSON body
        self.folders: list[dict] = [{"id": 3, "uid": "ops-folder", "title": "ops"}]
        self.dashboards: dict[str, dict] = {}  # uid -> the saved request body

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _GrafanaHandler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _request(self) -> dict | None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        self.server.requests.append((self.command, self.path, body))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._answer(401, {"message": "invalid API key"})
            return None
        if length and not self.headers.get("Content-Type", "").startswith("application/json"):
            self._answer(415, {"message": "unsupported content type"})
            return None
        return body

    def do_GET(self) -> None:
        if self._request() is None:
            return
        if self.path.split("?")[0] == "/api/folders":
            self._answer(200, self.server.folders)
        else:
            self._answer(404, {"message": "Not found"})

    def do_POST(self) -> None:
        body = self._request()
        if body is None:
            return
        if self.path == "/api/folders":
            self._create_folder(body)
        elif self.path == "/api/dashboards/db":
            self._save_dashboard(body)
        else:
            self._answer(404, {"message": "Not found"})

    def _create_folder(self, body: dict) -> None:
        title = body.get("title")
        if not title:
            self._answer(400, {"message": "folder title cannot be empty"})
            return
        if any(f["title"] == title for f in self.server.folders):
            self._answer(409, {"message": "a folder with the same name already exists"})
            return
        folder = {"id": 10 + len(self.server.folders), "uid": f"f{len(self.server.folders)}",
                  "title": title}
        self.server.folders.append(folder)
        self._answer(200, {**folder, "url": f"/dashboards/f/{folder['uid']}/", "version": 1})

    def _save_dashboard(self, body: dict) -> None:
        dashboard = body.get("dashboard")
        if not isinstance(dashboard, dict) or not dashboard.get("title"):
            self._answer(400, {"message": "Dashboard title cannot be empty"})
            return
        uid = dashboard.get("uid", "")
        if not UID.match(uid):
            self._answer(400, {"message": "uid contains illegal characters"})
            return
        if dashboard.get("id") is not None:  # an id that is not this server's
            self._answer(404, {"message": "Dashboard not found"})
            return
        folder_uid = body.get("folderUid")
        if folder_uid and all(f["uid"] != folder_uid for f in self.server.folders):
            self._answer(400, {"message": "folder not found"})
            return
        if uid in self.server.dashboards and not body.get("overwrite"):
            self._answer(412, {"message": "A dashboard with the same uid already exists",
                               "status": "name-exists"})
            return
        version = self.server.dashboards.get(uid, {}).get("version", 0) + 1
        self.server.dashboards[uid] = {**body, "version": version}
        self._answer(200, {"id": len(self.server.dashboards), "uid": uid,
                           "url": f"/d/{uid}/{uid}", "status": "success",
                           "version": version, "slug": uid})


@pytest.fixture
def grafana():
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_push_follows_grafanas_http_api_contract(grafana):
    """There is no Grafana server package for this machine, so the push is tested against
    the HTTP contract it relies on: folder lookup (GET /api/folders) and creation (POST
    /api/folders {"title"}), then POST /api/dashboards/db with {"dashboard", "overwrite":
    true, "folderUid"} per dashboard, authenticated with "Authorization: Bearer <token>"."""
    pushed = push_dashboards(url=grafana.url, token=TOKEN, folder="ringray")
    assert [(m, p) for m, p, _ in grafana.requests] == [
        ("GET", "/api/folders"), ("POST", "/api/folders"),
        ("POST", "/api/dashboards/db"), ("POST", "/api/dashboards/db"),
    ]
    assert grafana.requests[1][2] == {"title": "ringray"}
    folder_uid = next(f["uid"] for f in grafana.folders if f["title"] == "ringray")
    for name in FILES:
        saved = grafana.dashboards[_load(name)["uid"]]
        assert saved["overwrite"] is True and saved["folderUid"] == folder_uid
        assert saved["dashboard"] == _load(name)
    assert [(p.uid, p.version) for p in pushed] == [("ringray-job", 1), ("ringray-ring", 1)]
    assert pushed[0].url == f"{grafana.url}/d/ringray-job/ringray-job"

    # Again: the folder is found, not created, and the same uids are updated in place.
    grafana.requests.clear()
    pushed = push_dashboards(url=grafana.url, token=TOKEN, folder="ringray")
    assert [m for m, _, _ in grafana.requests] == ["GET", "POST", "POST"]
    assert [p.version for p in pushed] == [2, 2]
    assert len(grafana.dashboards) == 2


def test_push_without_a_folder_goes_to_general(grafana):
    push_dashboards(url=grafana.url, token=TOKEN)
    assert [p for _, p, _ in grafana.requests] == ["/api/dashboards/db"] * 2
    assert all("folderUid" not in body for _, _, body in grafana.requests)


def test_push_into_an_existing_folder(grafana):
    push_dashboards(url=grafana.url, token=TOKEN, folder="ops")
    assert [m for m, _, _ in grafana.requests] == ["GET", "POST", "POST"]
    assert {d["folderUid"] for d in grafana.dashboards.values()} == {"ops-folder"}


def test_cli_push_prints_the_dashboards_urls(grafana):
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url,
                                      "--token", TOKEN, "--folder", "ringray"])
    assert result.exit_code == 0, result.output
    assert f"{grafana.url}/d/ringray-job/ringray-job" in result.output
    assert f"{grafana.url}/d/ringray-ring/ringray-ring" in result.output


def test_cli_push_reads_the_token_from_the_environment(grafana):
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url],
                                env={"GRAFANA_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    assert len(grafana.dashboards) == 2


def test_cli_push_with_a_bad_token_is_one_line(grafana):
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url,
                                      "--token", "wrong"])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    message = " ".join(result.output.split())  # the console wraps a long line at 80 columns
    assert message == (f"error: Grafana at {grafana.url}: saving dashboard 'ringray-job': "
                       "HTTP 401: invalid API key")
    assert not grafana.dashboards


def test_push_to_nothing_listening_names_the_address():
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()  # the port is free now: nothing answers there
    expected = rf"^Grafana at {url}: listing folders: cannot connect \(.*Connection refused\)$"
    with pytest.raises(DashboardPushError, match=expected):
        push_dashboards(url=url, token=TOKEN, folder="ringray", timeout_seconds=2)


def test_push_rejects_an_address_without_a_scheme():
    with pytest.raises(DashboardPushError, match="--url 'grafana:3000'"):
        push_dashboards(url="grafana:3000", token=TOKEN)


@pytest.mark.parametrize(("url", "why"), [
    ("http://[::1", "not a valid URL \\(Invalid IPv6 URL\\)"),
    ("http://grafana:99999", "not a valid URL \\(Port out of range"),
    ("http://grafana:abc", "not a valid URL \\(Port could not be cast"),
    ("http://", "no host"),
])
def test_push_rejects_a_malformed_address_in_one_line(url: str, why: str) -> None:
    """urllib's ValueError escaped as a traceback before."""
    with pytest.raises(DashboardPushError, match=rf"^--url '{re.escape(url)}': {why}"):
        push_dashboards(url=url, token=TOKEN)
