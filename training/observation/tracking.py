"""Weights & Biases (``monitor.wandb=true``): every train and eval record metrics.jsonl gets, from the rank that
writes it.

DeepSpeed's own ``wandb`` monitor logs the engine's loss and learning rate only, under a new run each start;
this logs what the progress line and metrics.jsonl hold (real tokens/s, padding, grad norm, MFU, memory, the
layout, each eval source), the resolved config, and keeps one run across resumes: the run id is kept in
``output_dir/wandb_run_id`` and a resumed job continues that run. ``WANDB_MODE=offline`` (no network)
writes the run under ``output_dir/wandb`` for ``wandb sync`` later.
"""

from __future__ import annotations

import os
import uuid

from training.resilience.all_ranks import writing

RUN_ID_FILE = "wandb_run_id"


def flat_values(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as W&B keys: ``train/<key>`` or ``eval/<key>`` (``eval/<source>/<key>`` for one
    of data.eval_sources), nested dicts (the layout, tokens per source) as ``<key>/<subkey>``; numbers only."""
    prefix = record["kind"] + (f"/{record['source']}" if record.get("source") else "")
    out = {}
    for key, value in record.items():
        if key in ("kind", "step", "source") or value is None:
            continue
        items = value.items() if isinstance(value, dict) else [("", value)]
        for sub, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{prefix}/{key}" + (f"/{sub}" if sub else "")] = v
    return out


def wandb_problems(output_dir: str) -> list[str]:
    """monitor.wandb=true where ``wandb.init`` would stop, after the model loaded, for want of credentials: online
    mode (WANDB_MODE, W&B's settings files) and no API key (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the netrc
    file ``wandb login`` writes, W&B's settings). Read as ``wandb.init`` reads them; W&B is not contacted."""
    from wandb.sdk.lib.wbauth import wbnetrc
    from wandb.sdk.wandb_settings import Settings

    settings = Settings(silent=True)  # a copy of what W&B's process-wide setup loads, without starting it
    config_dir = os.path.expanduser(os.environ.get("WANDB_CONFIG_DIR", os.path.join("~", ".config", "wandb")))
    settings.settings_system = os.path.join(config_dir, "settings")
    settings.update_from_system_settings()
    settings.update_from_env_vars(dict(os.environ))
    if settings._offline or settings._noop:
        return []
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.api_key:
        return []
    if wbnetrc.read_netrc_auth(host=settings.base_url):
        return []
    return [
        f"monitor.wandb=true logs to W&B online ({settings.base_url}), and no API key is set here: run `wandb login` "
        f"or set WANDB_API_KEY, or set WANDB_MODE=offline to write the run under {output_dir}/wandb for `wandb sync` "
        "later"
    ]


class WandbRun:
    """One W&B run for ``output_dir``, continued on resume; called with each metrics.jsonl record."""

    def __init__(self, monitor, output_dir: str, config: dict):
        import wandb

        path = os.path.join(output_dir, RUN_ID_FILE)
        run_id = open(path).read().strip() if os.path.exists(path) else uuid.uuid4().hex[:8]
        self.run = wandb.init(
            project=monitor.wandb_project,
            entity=monitor.wandb_entity or None,
            name=monitor.wandb_run_name or os.path.basename(os.path.abspath(output_dir)),
            group=monitor.wandb_group or None,
            tags=list(monitor.wandb_tags) or None,
            id=run_id,
            resume="allow",
            dir=output_dir,
            config=config,
        )
        tmp = path + ".tmp"
        with writing(path):
            with open(tmp, "w") as f:
                f.write(run_id)
            os.replace(tmp, path)

    def __call__(self, record: dict) -> None:
        self.run.log(flat_values(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()
