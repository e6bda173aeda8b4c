"""Orchestration of the DVC pipeline with Prefect: flows, deployments, DVC helpers (docs/ORCHESTRATION.md).

    $ python -m pipelines run | experiments KEY=V1,V2 | serve     (see pipelines/__main__.py)

`pipelines.flows` (the two flows, their artifacts), `pipelines.serve` (both as deployments),
`pipelines.dvc` (stage graph, stages, experiments, failure classes; no Prefect), `pipelines.process` (a
streamed subprocess whose process group never outlives its caller). Nothing in `codi/` imports this
package: `dvc repro` runs the same pipeline without Prefect. Importing it sets OFFLINE_DEFAULTS.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

# Set before Prefect is imported (it reads its settings and DO_NOT_TRACK at import), in this process and so
# in every subprocess it starts (Prefect's temporary server, dvc, the stages). A variable already in the
# environment, or a setting of the active Prefect profile (`prefect config set`), wins.
OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",  # the temporary server's first start builds its
                                                                # database: over Prefect's 20 s on 2 cores
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",    # the server's telemetry service (sens-o-matic.prefect.io)
    "DO_NOT_TRACK": "1",                            # Prefect's SDK events (Amplitude), also huggingface_hub's
    "DVC_NO_ANALYTICS": "1",                        # DVC's analytics reporter
}


def _profile_settings() -> dict[str, object]:
    """The settings of the active Prefect profile, read as Prefect reads them (without importing it)."""
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    active = os.environ.get("PREFECT_PROFILE") or data.get("active") or "ephemeral"
    profile = (data.get("profiles") or {}).get(active)
    return profile if isinstance(profile, dict) else {}


def _set_offline_defaults() -> None:
    profile = _profile_settings()
    for key, value in OFFLINE_DEFAULTS.items():
        if key not in profile:
            os.environ.setdefault(key, value)


_set_offline_defaults()
