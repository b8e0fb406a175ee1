"""The configuration reference, docs/configuration.md, generated from ``training/configuration/schema.py``.

Every key's default is the dataclass's and its doc is the comment on the field's line and/or the
comment lines directly above it, so the reference cannot drift from the code: ``tests/test_docs.py``
fails when docs/configuration.md differs from :func:`render`, and ``python tools/gen_config_docs.py``
rewrites it. The source is read with ``ast`` and ``tokenize``, never imported (no torch, no DeepSpeed,
no Hydra needed). The Hydra groups come from the listings of ``conf/model``, ``conf/ds`` and
``conf/data``: each entry's leading comment and the keys it sets.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import tokenize
from dataclasses import dataclass

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_SOURCE = os.path.join("training", "configuration", "schema.py")  # relative to the repo root
ROOT_CLASS = "TrainConfig"
GROUPS = ("model", "ds", "data")  # conf/<group>/*.yaml, in the order the reference lists them
OUTPUT = os.path.join("docs", "configuration.md")
GENERATOR = "tools/gen_config_docs.py"


@dataclass
class Field:
    key: str  # dotted key as written on the command line (optim.lr)
    type: str  # the annotation as written, plus the choices of an Enum or Literal
    default: str  # the dataclass default, in Hydra/YAML notation
    doc: str  # the field's comments, joined


@dataclass
class Section:
    prefix: str  # "" for TrainConfig, "optim." for a nested dataclass
    cls: str
    doc: str  # the class docstring
    fields: list[Field]


class _Module:
    """One parsed source file: its classes, module-level constants, imports and comments."""

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as f:
            self.source = f.read()
        self.path = path
        self.lines = self.source.splitlines()
        self.source_lines = io.StringIO(self.source, newline="").readlines()  # split as the parser splits, ends kept
        self.tree = ast.parse(self.source, filename=path)
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        self.constants = {}
        self.imports = {}  # name -> (module, original name) for `from module import name`
        for node in self.tree.body:
            targets = []
            if isinstance(node, ast.Assign):
                targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                targets = [node.target.id]
            for name in targets:
                self.constants[name] = node.value
                enum = _functional_enum(node.value)
                if enum is not None:
                    self.classes[name] = enum
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imports[alias.asname or alias.name] = (node.module, alias.name)
        # Comments by line: (text, whole-line comment?)
        self.comments: dict[int, tuple[str, bool]] = {}
        for tok in tokenize.generate_tokens(io.StringIO(self.source).readline):
            if tok.type == tokenize.COMMENT:
                line = tok.start[0]
                whole = not self.lines[line - 1][: tok.start[1]].strip()
                self.comments[line] = (tok.string.lstrip("#").strip(), whole)

    def segment(self, node: ast.AST) -> str:
        """``ast.get_source_segment(self.source, node) or ""`` from the lines split once (that function splits the
        whole file, a character at a time, at every call: a second of the reference's rendering)."""
        if getattr(node, "end_lineno", None) is None or getattr(node, "end_col_offset", None) is None:
            return ""
        first, last = node.lineno - 1, node.end_lineno - 1
        head = self.source_lines[first].encode()  # the offsets count UTF-8 bytes
        if first == last:
            return head[node.col_offset : node.end_col_offset].decode()
        tail = self.source_lines[last].encode()[: node.end_col_offset].decode()
        return "".join([head[node.col_offset :].decode(), *self.source_lines[first + 1 : last], tail])

    def field_doc(self, node: ast.AST) -> str:
        """Comment lines directly above the field, then the comment(s) on its own line(s)."""
        above = []
        line = node.lineno - 1
        while line >= 1 and line in self.comments and self.comments[line][1]:
            above.insert(0, self.comments[line][0])
            line -= 1
        inline = [
            self.comments[n][0]
            for n in range(node.lineno, node.end_lineno + 1)
            if n in self.comments and not self.comments[n][1]
        ]
        return " ".join(part for part in above + inline if part)


class _Resolver:
    """Finds a class (dataclass or Enum) by name in config.py or in a repo module it imports from."""

    def __init__(self, root: str, main: _Module):
        self.root = root
        self.main = main
        self.cache: dict[str, _Module] = {}

    def module_of(self, dotted: str) -> _Module | None:
        path = os.path.join(self.root, *dotted.split(".")) + ".py"
        if not os.path.isfile(path):
            return None
        if path not in self.cache:
            self.cache[path] = _Module(path)
        return self.cache[path]

    def find_class(self, name: str, module: _Module | None = None) -> tuple[_Module, ast.ClassDef] | None:
        module = module or self.main
        if name in module.classes:
            return module, module.classes[name]
        if name in module.imports:
            source, original = module.imports[name]
            other = self.module_of(source)
            if other is not None and other is not module:
                return self.find_class(original, other)
        return None

    def constant(self, name: str, module: _Module) -> ast.AST | None:
        if name in module.constants:
            return module.constants[name]
        if name in module.imports:
            source, original = module.imports[name]
            other = self.module_of(source)
            if other is not None and other is not module:
                return self.constant(original, other)
        return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _is_enum(cls: ast.ClassDef) -> bool:
    names = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in cls.bases]
    return any(n.endswith("Enum") for n in names)


def _functional_enum(node: ast.AST) -> ast.ClassDef | None:
    """``Name = StrEnum("Name", {"1f1b": "1f1b", ...})``, an Enum's functional form (members whose names are no
    identifiers), as the class statement it stands for: one ``name = value`` per member. Members as a dict, a list
    of (name, value) pairs or of names, written out."""
    if not (isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    if not (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")).endswith("Enum"):
        return None
    try:
        members = ast.literal_eval(node.args[1])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if isinstance(members, str):
        members = members.replace(",", " ").split()
    pairs = members.items() if isinstance(members, dict) else [m if isinstance(m, tuple) else (m, m) for m in members]
    body = [ast.Assign(targets=[ast.Name(id=str(name))], value=ast.Constant(value)) for name, value in pairs]
    return ast.ClassDef(name=str(node.args[0].value), bases=[func], keywords=[], body=body, decorator_list=[])


def _enum_members(cls: ast.ClassDef) -> list[str]:
    members = []
    for node in cls.body:
        if isinstance(node, ast.Assign):
            members += [t.id for t in node.targets if isinstance(t, ast.Name) and not t.id.startswith("_")]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            members.append(node.target.id)
    return members


def _scalar(value) -> str:
    """A Python value in Hydra/YAML notation, as typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}"
    return repr(value)


class _Renderer:
    def __init__(self, root: str):
        self.root = root
        self.main = _Module(os.path.join(root, CONFIG_SOURCE))
        self.resolver = _Resolver(root, self.main)

    # ---- defaults -------------------------------------------------------------------------------

    def default(self, node: ast.AST | None, module: _Module) -> tuple[str, str | None]:
        """(rendered default, nested dataclass name or None) of a field's value expression."""
        if node is None:
            return "(required)", None
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "field":
            kwargs = {k.arg: k.value for k in node.keywords}
            if "default" in kwargs:
                return self.default(kwargs["default"], module)
            factory = kwargs.get("default_factory")
            if isinstance(factory, ast.Lambda):
                return self.default(factory.body, module)
            if isinstance(factory, ast.Name):
                found = self.resolver.find_class(factory.id, module)
                if found is not None and _is_dataclass(found[1]):
                    return "", factory.id
                builtins = {"list": "[]", "dict": "{}", "set": "[]", "tuple": "[]"}
                if factory.id in builtins:
                    return builtins[factory.id], None
            return module.segment(node), None
        return self.expression(node, module), None

    def expression(self, node: ast.AST, module: _Module) -> str:
        # Numbers keep their spelling (3e-4, not 0.0003).
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return module.segment(node)
        if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
            return module.segment(node)
        if isinstance(node, (ast.List, ast.Tuple)):
            return "[" + ", ".join(self.expression(e, module) for e in node.elts) + "]"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            found = self.resolver.find_class(node.value.id, module)
            if found is not None and _is_enum(found[1]):
                return node.attr  # an Enum member is set by its name on the command line
            constant = self.resolver.constant(node.value.id, module)
            if constant is None:
                return module.segment(node)
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):  # Enum["1f1b"]
            found = self.resolver.find_class(node.value.id, module)
            if found is not None and _is_enum(found[1]) and isinstance(node.slice, ast.Constant):
                return str(node.slice.value)  # a member whose name is no identifier, set by it all the same
        if isinstance(node, ast.Name) and node.id == "MISSING":
            return "??? (required)"  # omegaconf.MISSING
        if isinstance(node, ast.Name):
            constant = self.resolver.constant(node.id, module)
            if constant is not None:
                return self.expression(constant, module)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("list", "tuple") and len(node.args) == 1:
            return self.expression(node.args[0], module)  # list(CONSTANT): the constant's value
        try:
            return _scalar(ast.literal_eval(node))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return module.segment(node)

    # ---- types ----------------------------------------------------------------------------------

    def type_of(self, annotation: ast.AST, module: _Module) -> str:
        text = module.segment(annotation)
        choices = self.choices(annotation, module)
        return f"{text}: {' | '.join(choices)}" if choices else text

    def choices(self, annotation: ast.AST, module: _Module) -> list[str]:
        """The allowed values of an Enum or Literal annotation (also inside Optional[...] / X | None)."""
        if isinstance(annotation, ast.Name):
            found = self.resolver.find_class(annotation.id, module)
            return _enum_members(found[1]) if found is not None and _is_enum(found[1]) else []
        if isinstance(annotation, ast.Subscript):
            head = getattr(annotation.value, "id", getattr(annotation.value, "attr", ""))
            inner = annotation.slice
            if head == "Literal":
                elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
                return [self.expression(e, module) for e in elts]
            if head == "Optional":
                return self.choices(inner, module)
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            return self.choices(annotation.left, module) or self.choices(annotation.right, module)
        return []

    # ---- sections -------------------------------------------------------------------------------

    def sections(self) -> list[Section]:
        out: list[Section] = []
        self._walk(ROOT_CLASS, "", self.main, out)
        return out

    def _walk(self, name: str, prefix: str, module: _Module, out: list[Section]) -> None:
        found = self.resolver.find_class(name, module)
        if found is None:
            raise ValueError(f"{CONFIG_SOURCE}: no dataclass {name}")
        module, cls = found
        section = Section(prefix, name, " ".join((ast.get_docstring(cls) or "").replace("``", "`").split()), [])
        out.append(section)
        nested = []
        for node in cls.body:
            if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
                continue
            if "ClassVar" in module.segment(node.annotation) or node.target.id.startswith("_"):
                continue
            default, child = self.default(node.value, module)
            key = prefix + node.target.id
            if child is not None:
                nested.append((child, key + ".", module))
                continue
            section.fields.append(Field(key, self.type_of(node.annotation, module), default, module.field_doc(node)))
        for child, child_prefix, child_module in nested:
            self._walk(child, child_prefix, child_module, out)


# ---- the Hydra groups ----------------------------------------------------------------------------


def _group_entry(path: str, group: str) -> tuple[str, list[str]]:
    """(description from the leading comment lines, "key=value" settings) of one group entry file."""
    import yaml  # PyYAML, a dependency of Hydra/OmegaConf

    with open(path, encoding="utf-8") as f:
        text = f.read()
    description, package = [], group
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("#"):
            break
        body = stripped.lstrip("#").strip()
        if body.startswith("@package"):
            package = body.split(None, 1)[1].strip() if len(body.split(None, 1)) > 1 else group
        elif body:
            description.append(body)
    values = yaml.safe_load(text) or {}
    prefix = "" if package == "_global_" else package + "."
    settings = []
    for key, value in values.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={_scalar(v)}" for k, v in value.items())
            settings.append(f"{prefix}{key}: {value}")
        else:
            settings.append(f"{prefix}{key}={_scalar(value)}")
    return " ".join(description), settings


def _group_defaults(root: str) -> dict[str, str]:
    """The entry conf/config.yaml selects for each group."""
    import yaml

    path = os.path.join(root, "conf", "config.yaml")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    out = {}
    for item in data.get("defaults", []):
        if isinstance(item, dict):
            for key, value in item.items():
                if isinstance(key, str) and not key.startswith("override ") and isinstance(value, str):
                    out[key] = value
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(root: str = REPO_ROOT) -> str:
    """docs/configuration.md, from training/configuration/schema.py and conf/."""
    renderer = _Renderer(root)
    sections = renderer.sections()
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated by `python {GENERATOR}` from `{CONFIG_SOURCE}` and `conf/`: do not edit by hand. -->",
        "",
        f"Generated from the dataclasses in `{CONFIG_SOURCE}` (defaults and per-field comments) and from the",
        "entries of `conf/model/`, `conf/ds/` and `conf/data/`. After changing either, run",
        f"`python {GENERATOR}`; `tests/test_docs.py` fails while this file is stale.",
        "",
        "Set any key on the command line as a Hydra override (`train.py num_stages=2 optim.lr=1e-4`), or pick a",
        "group entry (`model=llama3-8b`, `ds=zero0`, `data=text`). Unknown keys and values of another type are",
        "refused before Hydra, each with the form the key takes (a list key given one value: `profile_steps=[5,6]`),",
        "unknown group entries by Hydra; the rules that involve several keys, the world size, the DeepSpeed JSON",
        "or files on disk are checked before any process group starts (see",
        "[training.md](training.md#configuration-checks)). `python train.py --cfg job` prints the resolved config;",
        "`python scripts/preflight.py --world-size N <overrides>` checks a command for N ranks. A float key takes a",
        "finite number (nan and inf are refused) in the range its line states.",
        "",
    ]
    defaults = _group_defaults(root)
    if defaults:
        chosen = ", ".join(f"`{g}={e}`" for g, e in defaults.items())
        out += [
            f"The defaults below are the dataclass's. `conf/config.yaml` selects {chosen}; the keys those",
            "entries set (listed under Hydra groups) take the entry's value.",
            "",
        ]
    for section in sections:
        title = f"`{section.prefix}*`" if section.prefix else "Top level"
        out += [f"## {title} ({section.cls})", ""]
        if section.doc:
            out += [section.doc, ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in section.fields:
            out.append(f"| `{f.key}` | {_cell(f.type)} | `{_cell(f.default)}` | {_cell(f.doc)} |")
        out.append("")
    out += ["## Hydra groups", "", "One YAML file per entry; `<group>=<entry>` on the command line selects it.", ""]
    for group in GROUPS:
        directory = os.path.join(root, "conf", group)
        if not os.path.isdir(directory):
            continue
        entries = sorted(f[: -len(".yaml")] for f in os.listdir(directory) if f.endswith(".yaml"))
        out += [f"### `{group}=` (conf/{group}/)", "", "| entry | what it is | sets |", "|---|---|---|"]
        for entry in entries:
            description, settings = _group_entry(os.path.join(directory, f"{entry}.yaml"), group)
            name = f"`{entry}`" + (" (default)" if defaults.get(group) == entry else "")
            sets = "<br>".join(f"`{_cell(s)}`" for s in settings)
            out.append(f"| {name} | {_cell(description)} | {sets} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Write docs/configuration.md; with --check, exit 1 if it is stale instead."""
    argv = sys.argv[1:] if argv is None else argv
    path = os.path.join(REPO_ROOT, OUTPUT)
    text = render()
    if "--check" in argv:
        current = open(path, encoding="utf-8").read() if os.path.isfile(path) else None
        if current != text:
            print(f"{OUTPUT} is stale: run python {GENERATOR}", file=sys.stderr)
            return 1
        print(f"{OUTPUT} is up to date")
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUTPUT}")
    return 0
