"""conf/config.yaml's defaults list names every entry of the model, ds and data groups on disk (its comments are
what a newcomer reads to pick one), and every conf/ds entry has its JSON in ds_configs/."""

from __future__ import annotations

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def listed(group: str) -> list[str]:
    """The entries conf/config.yaml's comment on ``- group: ...`` lists (``conf/<group>/: a | b (...)``)."""
    with open(os.path.join(REPO, "conf", "config.yaml")) as f:
        for line in f:
            m = re.match(rf"\s*- {group}: \S+\s+# conf/{group}/: ([^(]+)", line)
            if m:
                return [name.strip() for name in m.group(1).split("|")]
    raise AssertionError(f"conf/config.yaml has no commented `- {group}:` line")


def on_disk(group: str) -> list[str]:
    return sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(REPO, "conf", group)) if f.endswith(".yaml"))


def test_the_defaults_comment_lists_every_group_entry():
    for group in ("model", "ds", "data"):
        names = listed(group)
        assert len(names) == len(set(names)), f"{group}: {names} lists an entry twice"
        assert sorted(names) == on_disk(group), (
            f"conf/config.yaml's {group} comment: {names}, conf/{group}/: {on_disk(group)}"
        )


def test_every_ds_entry_has_its_json():
    jsons = sorted(f.removesuffix(".json") for f in os.listdir(os.path.join(REPO, "ds_configs")))
    assert on_disk("ds") == jsons
