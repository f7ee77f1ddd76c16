from __future__ import annotations

from tests._support.server_fixtures import model_dir, pipe, server_env, session_cache_root  # noqa: F401  (session fixtures)

