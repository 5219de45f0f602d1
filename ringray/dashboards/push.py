"""Push the dashboards to a Grafana server through its HTTP API (``grafana-client``).

    results = push_dashboards(url="https://grafana.example.com", token="glsa_...",
                              folder="ringray")
    for r in results: print(r.title, r.url)

Each dashboard goes to ``POST /api/dashboards/db`` with ``overwrite: true``: its uid is stable,
so pushing again updates the dashboards in place (Grafana keeps the earlier versions). With a
folder name, the folder is looked up by title (``GET /api/folders``) and created when missing
(``POST /api/folders``). The token is a Grafana service-account token, sent as
``Authorization: Bearer``.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from ringray.dashboards.build import Dashboard, as_json
from ringray.dashboards.build import dashboards as build_dashboards


class DashboardPushError(RuntimeError):
    """Grafana refused a request or could not be reached; the message is one line."""


@dataclass(frozen=True)
class PushedDashboard:
    title: str
    uid: str
    url: str  # the dashboard's address on the server
    version: int


def push_dashboards(*, url: str, token: str, folder: str | None = None,
                    dashboards: list[Dashboard] | None = None,
                    timeout_seconds: float = 10.0) -> list[PushedDashboard]:
    """Create or update every dashboard (default: all of ringray's) on the Grafana at ``url``.

    Raises:
        DashboardPushError: naming the request that failed and Grafana's message.
    """
    from grafana_client import GrafanaApi

    if not url.startswith(("http://", "https://")):
        raise DashboardPushError(f"--url {url!r}: expected http://host[:port] or https://...")
    try:  # urllib's own checks: a bracket left open, a port out of range or not a number
        parsed = urllib.parse.urlsplit(url)
        parsed.port  # noqa: B018 - read for its ValueError
    except ValueError as exc:
        raise DashboardPushError(f"--url {url!r}: not a valid URL ({exc}); expected "
                                 f"http://host[:port] or https://...") from None
    if not parsed.hostname:
        raise DashboardPushError(f"--url {url!r}: no host; expected http://host[:port] or "
                                 f"https://...")
    api = GrafanaApi.from_url(url, credential=token, timeout=timeout_seconds)
    boards = list(build_dashboards().values()) if dashboards is None else dashboards
    folder_uid = _folder_uid(api, folder, url) if folder else None
    pushed = []
    for board in boards:
        payload: dict = {"dashboard": as_json(board), "overwrite": True,
                         "message": "ringray dashboards push"}
        if folder_uid is not None:
            payload["folderUid"] = folder_uid
        answer = _call(url, f"saving dashboard {board.uid!r}", dict,
                       lambda payload=payload: api.dashboard.update_dashboard(payload))
        pushed.append(PushedDashboard(
            title=board.title, uid=answer.get("uid", board.uid),
            url=url.rstrip("/") + answer.get("url", f"/d/{board.uid}"),
            version=int(answer.get("version", 0)),
        ))
    return pushed


def _folder_uid(api, title: str, url: str) -> str:
    """The uid of the top-level folder called ``title``, created when there is none."""
    folders = _call(url, "listing folders", list, api.folder.get_all_folders)
    for existing in folders:
        if existing.get("title") == title:
            return existing["uid"]
    created = _call(url, f"creating folder {title!r}", dict,
                    lambda: api.folder.create_folder(title=title))
    return created["uid"]


def _call(url: str, what: str, expected: type, request):
    """``request()``'s JSON answer, which must be an ``expected`` (a dict or a list)."""
    from grafana_client.client import GrafanaException
    from niquests.exceptions import RequestException

    try:
        answer = request()
    except GrafanaException as exc:
        # Grafana's own words ({"message": ...}) say more than the client's "Unauthorized".
        said = exc.response.get("message") if isinstance(exc.response, dict) else None
        status = f"HTTP {exc.status_code}: " if exc.status_code else ""
        raise DashboardPushError(f"Grafana at {url}: {what}: {status}"
                                 f"{_one_line(said or exc.message)}") from None
    except RequestException as exc:
        # The reason ("... [Errno 111] Connection refused") without urllib3's nesting.
        reason = re.search(r">: (.+?)['\"]?\)*$", _one_line(str(exc)))
        raise DashboardPushError(f"Grafana at {url}: {what}: cannot connect "
                                 f"({reason[1] if reason else _one_line(str(exc))})") from None
    if not isinstance(answer, expected):
        raise DashboardPushError(f"Grafana at {url}: {what}: expected a JSON "
                                 f"{expected.__name__}, got {_one_line(str(answer))[:120]!r} "
                                 "(is this Grafana's address?)")
    return answer


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
