"""docs/: the configuration reference and the test catalogue are the generated ones, and every link into docs/ resolves.

docs/configuration.md is written by ``python tools/gen_config_docs.py`` from training/configuration/schema.py's
dataclasses (defaults and per-field comments) and the conf/ groups; editing either without regenerating fails here. So
does a test module added, removed or given another docstring without ``python tools/gen_test_catalogue.py``
(docs/testing.md's catalogue). Links are checked from README.md and from every docs/*.md file: the target file exists
and, for ``file.md#anchor``, a heading of that file has that GitHub anchor.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from tests.support import REPO
from tools import config_docs, gen_module_map, gen_test_catalogue

DOCS = os.path.join(REPO, "docs")
CONFIGURATION = os.path.join(DOCS, "configuration.md")
TESTING = os.path.join(DOCS, "testing.md")
LINKED_FROM = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(DOCS, "*.md")))]


@pytest.fixture(scope="module")
def rendered_alone() -> subprocess.CompletedProcess:
    """docs/configuration.md as the generator renders it in a process of its own, which then names any of torch,
    DeepSpeed or transformers it imported (it reads the source: the docs build needs none of them)."""
    code = (
        "import sys; from tools.config_docs import render; sys.stdout.write(render()); "
        "print([m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules], file=sys.stderr)"
    )
    return subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)


def test_configuration_reference_is_not_stale(rendered_alone):
    with open(CONFIGURATION, encoding="utf-8") as f:
        current = f.read()
    assert current == rendered_alone.stdout, "docs/configuration.md is stale: run python tools/gen_config_docs.py"


def test_every_train_config_field_is_documented():
    """Every key of TrainConfig and its nested dataclasses appears in the reference with a doc comment."""
    sections = config_docs._Renderer(REPO).sections()
    keys = [f.key for s in sections for f in s.fields]
    assert {"num_stages", "optim.lr", "data.train_file", "monitor.csv", "model.tokenizer"} <= set(keys)
    assert len(keys) == len(set(keys))
    undocumented = [f.key for s in sections for f in s.fields if not f.doc]
    assert not undocumented, f"fields without a comment in training/configuration/schema.py: {undocumented}"


def test_the_generator_reads_source_without_importing_torch_or_deepspeed(rendered_alone):
    assert rendered_alone.stderr.strip().splitlines()[-1] == "[]"


def test_render_follows_field_comments_defaults_enums_and_groups(tmp_path):
    """A stand-in repo: comments above and beside a field, numbers as written, an Enum, a nested
    dataclass, a default_factory, and a group entry with @package _global_."""
    (tmp_path / "training" / "configuration").mkdir(parents=True)
    (tmp_path / "training" / "configuration" / "schema.py").write_text('''
import enum
from dataclasses import dataclass, field
from typing import Optional

DEFAULT_LR = 3e-4

class Precision(str, enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"

@dataclass
class Inner:
    """Inner ``docs``."""
    lr: float = DEFAULT_LR  # peak rate | the one
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])

@dataclass
class TrainConfig:
    """Top."""
    # Above, line one;
    # line two.
    steps: int = -1  # beside
    precision: Precision = Precision.bf16  # the dtype
    packing: Optional[bool] = None
    tags: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)
''')
    for group, name, text in (
        ("ds", "zero1", "# @package _global_\n# Selects zero1.\nds_config: zero1\n"),
        ("data", "text", "# Raw text.\nformat: text\npacking: true\n"),
    ):
        (tmp_path / "conf" / group).mkdir(parents=True)
        (tmp_path / "conf" / group / f"{name}.yaml").write_text(text)
    (tmp_path / "conf" / "config.yaml").write_text("defaults:\n  - _self_\n  - ds: zero1\n")
    text = config_docs.render(str(tmp_path))
    assert "| `steps` | int | `-1` | Above, line one; line two. beside |" in text
    assert "| `precision` | Precision: fp32 \\| bf16 | `bf16` | the dtype |" in text
    assert "| `packing` | Optional[bool] | `null` |  |" in text
    assert "| `tags` | list[str] | `[]` |  |" in text
    assert "| `inner.lr` | float | `3e-4` | peak rate \\| the one |" in text
    assert "| `inner.betas` | list[float] | `[0.9, 0.95]` |  |" in text
    assert "Inner `docs`." in text
    assert "| `zero1` (default) | Selects zero1. | `ds_config=zero1` |" in text
    assert "| `text` | Raw text. | `data.format=text`<br>`data.packing=true` |" in text


def test_test_catalogue_is_not_stale():
    with open(TESTING, encoding="utf-8") as f:
        current = f.read()
    expected = gen_test_catalogue.updated(current, gen_test_catalogue.render())
    assert current == expected, "docs/testing.md's test catalogue is stale: run python tools/gen_test_catalogue.py"


def test_module_map_is_not_stale():
    """docs/architecture.md's module map: every module of the packages, entry points, scripts, benchmarks and tools,
    with its docstring's first sentence."""
    with open(os.path.join(REPO, gen_module_map.OUTPUT), encoding="utf-8") as f:
        current = f.read()
    assert current == gen_module_map.updated(current), "the module map is stale: run python tools/gen_module_map.py"
    assert "| `training/configuration/schema.py` |" in current and "| `models/files/hf_convert.py` |" in current


def test_module_map_refuses_a_module_without_a_docstring(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n")
    with pytest.raises(gen_module_map.MapError, match="m.py has no module docstring"):
        gen_module_map.first_sentence(str(tmp_path / "m.py"))
    (tmp_path / "d.py").write_text('"""Holds a thing, e.g. this. More words.\n\nDetail."""\n')
    assert gen_module_map.first_sentence(str(tmp_path / "d.py")) == "Holds a thing, e.g. this."


def test_the_catalogue_lists_every_test_module_once():
    with open(TESTING, encoding="utf-8") as f:
        text = f.read()
    listed = re.findall(r"^- `tests/(test_\w+\.py)`", text, flags=re.M)
    on_disk = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "tests", "test_*.py")))
    assert sorted(listed) == on_disk


def test_the_catalogue_names_a_module_in_no_area_or_without_a_docstring(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_stage_parity.py").write_text('"""Stages.\n\nMore."""\n')
    (tmp_path / "tests" / "test_new.py").write_text("def test_x():\n    pass\n")
    with pytest.raises(gen_test_catalogue.CatalogueError) as e:
        gen_test_catalogue.render(str(tmp_path))
    said = str(e.value).splitlines()
    assert "tests/test_new.py is in no area: add it to AREAS in tools/gen_test_catalogue.py" in said
    assert "tools/gen_test_catalogue.py lists test_families, which is not in tests/: remove it from AREAS" in said
    assert "tests/test_new.py has no docstring: open it with one whose first sentence says what it checks" in said


def test_a_catalogue_entry_is_the_first_paragraph_and_the_tiers_of_its_markers():
    tree = ast.parse(
        '"""What it\nchecks.\n\nDetails."""\nimport pytest\n\n@pytest.mark.multirank\ndef test_a(): pass\n'
    )
    assert gen_test_catalogue.entry("test_x", tree) == "- `tests/test_x.py` (fast, multi-rank): What it checks."
    tree.body.insert(1, ast.parse("pytestmark = [pytest.mark.e2e]").body[0])
    assert gen_test_catalogue.entry("test_x", tree) == "- `tests/test_x.py` (e2e): What it checks."


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # no headings inside code blocks
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        anchor = github_anchor(heading)
        n = seen.get(anchor, 0)
        seen[anchor] = n + 1
        out.add(anchor if n == 0 else f"{anchor}-{n}")
    return out


def markdown_links(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return re.findall(r"\]\(([^)\s]+)\)", text)


def local_links() -> list[tuple[str, str]]:
    out = []
    for source in LINKED_FROM:
        for target in markdown_links(source):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            out.append((os.path.relpath(source, REPO), target))
    return out


def test_readme_links_into_docs():
    targets = [t for s, t in local_links() if s == "README.md"]
    for name in ("configuration", "training", "data", "checkpoints", "zero", "multinode", "troubleshooting", "testing"):
        assert f"docs/{name}.md" in [t.split("#")[0] for t in targets], f"README.md does not link docs/{name}.md"


@pytest.mark.parametrize("source,target", local_links())
def test_link_resolves(source, target):
    path, _, anchor = target.partition("#")
    base = os.path.join(REPO, os.path.dirname(source))
    resolved = os.path.normpath(os.path.join(base, path)) if path else os.path.join(REPO, source)
    assert os.path.exists(resolved), f"{source}: link {target} points at a missing file"
    if anchor:
        assert resolved.endswith(".md"), f"{source}: anchor on a non-markdown file: {target}"
        assert anchor in anchors(resolved), f"{source}: link {target}: no heading with anchor #{anchor}"


def test_generator_script_is_thin():
    with open(os.path.join(REPO, "tools", "gen_config_docs.py")) as f:
        tree = ast.parse(f.read())
    assert not [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
