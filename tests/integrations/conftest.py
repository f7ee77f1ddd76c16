from __future__ import annotations

from tests.server.fixtures import model_dir, pipe, session_cache_root  # noqa: F401  (session fixtures)

