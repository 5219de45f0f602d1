"""What a finished job left on a Ray cluster: ``python tests/ray_leftovers.py ADDRESS`` prints,
as JSON, the actors still alive (their class names) and the placement groups not removed
(their names), in every namespace. A test runs it after a job where the driver's process
cannot reach the cluster itself (on another host)."""

from __future__ import annotations

import json
import sys

import ray
from ray._private import state  # the GCS's own tables: no dashboard needed


def leftovers() -> dict[str, list[str]]:
    actors = sorted(info.get("ActorClassName") or info.get("Name") or "?"
                    for info in state.actors().values() if info.get("State") != "DEAD")
    groups = sorted(info.get("name") or info.get("placement_group_id", "?")
                    for info in ray.util.placement_group_table().values()
                    if info.get("state") != "REMOVED")
    return {"actors": actors, "placement_groups": groups}


if __name__ == "__main__":
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    try:
        print(json.dumps(leftovers()))
    finally:
        ray.shutdown()
