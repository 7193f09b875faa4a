"""Token-capture proxy: speaks each harness's wire API, calls the engine with
token ids, and records exactly what was sampled (see WORKSPACE.md)."""

from rollout_server.proxy.app import build_app
from rollout_server.proxy.service import ProxyCore, build_core
from rollout_server.proxy.session import Session, SessionCaps, SessionSpec, SessionStore

__all__ = ["ProxyCore", "Session", "SessionCaps", "SessionSpec", "SessionStore", "build_app", "build_core"]
