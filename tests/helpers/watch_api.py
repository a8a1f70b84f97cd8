"""The Kubernetes API as the watch's reports use it (get_node, patch_status, create_event),
recorded in memory: for the unit and hostile tests of the watch (once.py, daemon.py, checks.py)."""

from __future__ import annotations

from typing import Any


class FakeApi:
    """The NodeApi calls the watch makes, recorded; the Node keeps the patched condition."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.conditions: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []

    def get_node(self, name: str) -> dict[str, Any]:
        self.calls.append(f"GET {name}")
        return {"metadata": {"name": name}, "status": {"conditions": list(self.conditions)}}

    def patch_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"PATCH {name}/status")
        self.conditions = body["status"]["conditions"]
        return {}

    def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(f"POST {namespace}/events")
        self.events.append(body)
        return {}
