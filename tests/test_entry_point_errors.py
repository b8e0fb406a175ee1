"""Entry points never destroy their own input, and end in one message, not a traceback.

convert2ckpt.py refuses an --output that is, contains or lies inside its --input (both directions,
whatever --overwrite says) and replaces only directories it wrote; damaged weight files are named
with what is wrong; generate.py and plot_metrics.py say what to do about a missing, unconverted or
damaged directory. Entry points run in-process (``main(argv)``, what ``__main__`` exits with) except
where running the script itself is the point.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from models.files.hf_convert import OUTPUT_MARKER, hf_to_stages
from models.llama_pipe import layer_file_name
from tests.support import REPO
from tests.support.scripts import load_entry_point
from tests.test_convert import hf_tensors, leftovers

convert2ckpt = load_entry_point("convert2ckpt.py")


def tree_digest(root) -> dict[str, str]:
    """Relative path -> sha256 of every file below ``root`` (what must survive a refused command)."""
    out = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def convert(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of ``convert2ckpt.py argv``."""
    code = convert2ckpt.main(list(argv))
    return code, capsys.readouterr().err


def truncate(path, fraction: float = 0.5) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * fraction)])


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory, tiny_hf) -> str:
    path = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    hf_to_stages(tiny_hf, path)
    return path


# ---------- 1: the converter never destroys its input ----------


@pytest.mark.parametrize(
    "relation, fragment",
    [
        ("equal", "is the --input directory"),
        ("parent", "contains the --input"),
        ("inside", "is inside the --input"),
        ("symlink", "is the --input directory"),
    ],
    ids=["equal", "parent", "inside", "symlink"],
)
@pytest.mark.parametrize("to_hf", [False, True], ids=["hf-to-stages", "to-hf"])
def test_output_overlapping_the_input_is_refused_and_the_input_is_intact(
    tmp_path, tiny_hf, tiny_ckpt, capsys, to_hf, relation, fragment
):
    box = tmp_path / "box"  # the input and an unrelated file beside it: a parent --output would delete both
    box.mkdir()
    src = box / "input"
    shutil.copytree(tiny_ckpt if to_hf else tiny_hf, src)
    (box / "notes.txt").write_text("unrelated work\n")
    if relation == "symlink":
        os.symlink(src, tmp_path / "link")
    output = {"equal": src, "parent": box, "inside": src / "export", "symlink": tmp_path / "link"}[relation]
    before = tree_digest(box)
    code, err = convert(
        capsys, *(["--to-hf"] if to_hf else []), "--input", str(src), "--output", str(output), "--overwrite"
    )
    assert code == 1
    assert err.startswith(f"convert2ckpt.py: error: --output {output}") and fragment in err, err
    assert "refused even with --overwrite" in err
    assert tree_digest(box) == before
    assert not leftovers(str(box)) and not leftovers(str(src)) and not leftovers(str(tmp_path))


@pytest.mark.parametrize("to_hf", [False, True], ids=["hf-to-stages", "to-hf"])
def test_overwrite_replaces_only_a_directory_the_converter_wrote(tmp_path, tiny_hf, tiny_ckpt, capsys, to_hf):
    src = tiny_ckpt if to_hf else tiny_hf
    way = ["--to-hf"] if to_hf else []
    foreign = tmp_path / "foreign"  # e.g. a model download, or another tool's output
    foreign.mkdir()
    (foreign / "model.safetensors").write_bytes(b"someone else's weights")
    code, err = convert(capsys, *way, "--input", src, "--output", str(foreign), "--overwrite")
    assert code == 1
    assert err == (
        f"convert2ckpt.py: error: refusing to replace {foreign}: it was not written by convert2ckpt.py "
        f"(it has no {OUTPUT_MARKER} marker); --overwrite replaces only a directory that convert2ckpt.py "
        f"wrote, as it wrote it. Remove {foreign} yourself or choose another --output\n"
    )
    assert (foreign / "model.safetensors").read_bytes() == b"someone else's weights"

    ours = tmp_path / "ours"
    assert convert(capsys, *way, "--input", src, "--output", str(ours))[0] == 0
    marker = json.loads((ours / OUTPUT_MARKER).read_text())
    assert marker["tool"] == "convert2ckpt.py" and marker["input"] == os.path.realpath(src)
    assert marker["direction"] == ("stages-to-hf" if to_hf else "hf-to-stages")
    assert sorted(marker["files"]) == sorted(n for n in os.listdir(ours) if n != OUTPUT_MARKER)
    (ours / "config.json").write_text("{}")  # a file it wrote, since changed: still its own to replace
    assert convert(capsys, *way, "--input", src, "--output", str(ours), "--overwrite")[0] == 0
    assert (ours / "config.json").read_text() != "{}" and not leftovers(str(tmp_path))

    # Files added since (a training run pointed at it) would be lost: refused, and they say which.
    (ours / "metrics.jsonl").write_text("{}\n")
    code, err = convert(capsys, *way, "--input", src, "--output", str(ours), "--overwrite")
    assert code == 1
    assert f"refusing to replace {ours}: files were added to it since convert2ckpt.py wrote it: metrics.jsonl;" in err
    assert (ours / "metrics.jsonl").read_text() == "{}\n"


def test_overwrite_of_an_empty_directory_is_allowed_and_of_a_link_or_file_refused(tmp_path, tiny_hf, capsys):
    (tmp_path / "empty").mkdir()
    assert convert(capsys, "--input", tiny_hf, "--output", str(tmp_path / "empty"), "--overwrite")[0] == 0
    assert (tmp_path / "empty" / "latest").is_file()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    code, err = convert(capsys, "--input", tiny_hf, "--output", str(tmp_path / "link"), "--overwrite")
    assert code == 1 and f"it is a symbolic link (to {tmp_path / 'elsewhere'})" in err
    (tmp_path / "file").write_text("x")
    code, err = convert(capsys, "--input", tiny_hf, "--output", str(tmp_path / "file"), "--overwrite")
    assert code == 1 and "it is a file, not a directory" in err and (tmp_path / "file").read_text() == "x"


# ---------- 6: damaged, missing or unconverted inputs end in a message ----------


def test_truncated_safetensors_is_named_with_its_sizes(tmp_path, tiny_hf, capsys):
    src = tmp_path / "hf"
    shutil.copytree(tiny_hf, src)
    weights = src / "model.safetensors"
    whole = os.path.getsize(weights)
    truncate(weights)
    code, err = convert(capsys, "--input", str(src), "--output", str(tmp_path / "out"))
    assert code == 1
    assert err == (
        f"convert2ckpt.py: error: {weights} is truncated: {whole // 2} of the {whole} bytes its header "
        f"describes (50%)\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("zip-half", "is truncated ({size} bytes): the end of its zip archive (the central directory) is missing"),
        ("legacy-half", "is truncated ({size} bytes): unexpected EOF"),
        ("empty", "is empty (0 bytes)"),
    ],
)
def test_damaged_bin_is_named_with_what_is_wrong(tmp_path, tiny_hf, capsys, damage, expected):
    src = tmp_path / "hf"
    src.mkdir()
    shutil.copy(os.path.join(tiny_hf, "config.json"), src)
    weights = src / "pytorch_model.bin"
    torch.save(hf_tensors(tiny_hf), weights, _use_new_zipfile_serialization=damage != "legacy-half")
    truncate(weights, 0 if damage == "empty" else 0.5)
    code, err = convert(capsys, "--input", str(src), "--output", str(tmp_path / "out"))
    assert code == 1
    assert err.startswith(f"convert2ckpt.py: error: {weights} " + expected.format(size=os.path.getsize(weights))), err


def test_damaged_layer_file_is_named_on_export(tmp_path, tiny_ckpt, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    layer = ckpt / "global_step0" / layer_file_name(2)
    truncate(layer)
    code, err = convert(capsys, "--to-hf", "--input", str(ckpt), "--output", str(tmp_path / "hf"))
    assert code == 1
    assert f"convert2ckpt.py: error: {layer} is truncated ({os.path.getsize(layer)} bytes)" in err
    layer.write_bytes(b"not a layer file")
    code, err = convert(capsys, "--to-hf", "--input", str(ckpt), "--output", str(tmp_path / "hf"))
    assert f"{layer} is not a torch.save zip archive (it starts with b'not a la')" in err


def test_converter_on_missing_or_unconverted_input(tmp_path, tiny_ckpt, capsys):
    code, err = convert(capsys, "--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out"))
    assert (code, err) == (1, f"convert2ckpt.py: error: --input {tmp_path / 'nowhere'} does not exist\n")
    code, err = convert(capsys, "--input", tiny_ckpt, "--output", str(tmp_path / "out"))
    assert code == 1 and err.endswith("It is a pipeline checkpoint: to export it to Hugging Face, add --to-hf.\n")


def test_generate_names_the_fix(tmp_path, tiny_hf, capsys):
    generate = load_entry_point("scripts/generate.py")
    missing = tmp_path / "nowhere"
    assert generate.main(["--model", str(missing)]) == 1
    assert capsys.readouterr().err == (
        f"generate.py: error: --model {missing} does not exist: pass a Hugging Face model "
        f"directory, e.g. one written by `python convert2ckpt.py --to-hf --input "
        f"CKPT_DIR --output HF_DIR`\n"
    )
    damaged = tmp_path / "hf"
    shutil.copytree(tiny_hf, damaged)
    truncate(damaged / "model.safetensors")
    assert generate.main(["--model", str(damaged)]) == 1
    assert capsys.readouterr().err.startswith(f"generate.py: error: {damaged / 'model.safetensors'} is truncated: ")


@pytest.mark.e2e
def test_generate_on_a_pipeline_checkpoint_names_the_export_command(tiny_ckpt):
    """As a script: the diagnosis imports the repo's modules itself (only scripts/ is on its module path)."""
    proc = subprocess.run(
        [sys.executable, "scripts/generate.py", "--model", tiny_ckpt],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"generate.py: error: {tiny_ckpt} is a pipeline checkpoint, not a Hugging Face model: export it with "
        f"`python convert2ckpt.py --to-hf --input {tiny_ckpt} --output {tiny_ckpt}-hf`, then pass --model "
        f"{tiny_ckpt}-hf"
    )


def plot(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/plot_metrics.py", *argv], cwd=REPO, capture_output=True, text=True)


@pytest.mark.e2e
def test_plot_metrics_on_a_missing_run(tmp_path):
    proc = plot(str(tmp_path / "nowhere"))
    assert (proc.returncode, proc.stderr) == (
        1,
        f"plot_metrics.py: error: {tmp_path / 'nowhere'} does not exist: pass a train.py output_dir\n",
    )
    proc = plot(str(tmp_path))
    assert proc.returncode == 1 and proc.stderr == (
        f"plot_metrics.py: error: {tmp_path / 'metrics.jsonl'} not found: {tmp_path} is not a train.py output_dir, "
        f"or its run has not finished a step\n"
    )


@pytest.mark.e2e
def test_plot_metrics_skips_and_counts_damaged_lines(tmp_path):
    good = [{"kind": "train", "step": s, "loss": 4.0 - s / 10, "lr": 1e-3} for s in range(1, 7)]
    lines = [json.dumps(r) for r in good]
    lines.insert(3, '{"kind": "train", "step": 4, "lo')  # a killed run's last line, then a restart
    lines.insert(5, json.dumps(good[0]) + json.dumps(good[1]))  # two runs' records on one line
    lines += [json.dumps({"kind": "eval", "step": 6, "eval_loss": 3.5}), "", '{"kind": "train", "step": 7']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    proc = plot(str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    path = tmp_path / "metrics.jsonl"
    assert proc.stderr == (
        f"plot_metrics.py: warning: skipped 3 damaged line(s) of {path} (lines 4, 6, 11): "
        f"not a complete metrics record\n"
    )
    assert proc.stdout == f"[plot] wrote {tmp_path / 'metrics.png'} (6 steps, 1 evals, 3 damaged line(s) skipped)\n"
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    path.write_text('{"kind": "train", "st\n')
    proc = plot(str(tmp_path))
    assert proc.returncode == 1
    assert (
        proc.stderr.splitlines()[-1]
        == f"plot_metrics.py: error: {path} has no training steps (1 damaged line(s) skipped)"
    )


def test_eval_hf_names_a_missing_or_unconverted_directory(tmp_path, tiny_ckpt, capsys):
    eval_hf = load_entry_point("scripts/eval_hf.py")
    assert eval_hf.main(["--model", str(tmp_path / "nowhere"), "--data", "x.jsonl"]) == 1
    assert "eval_hf.py: error: --model " in capsys.readouterr().err
    assert eval_hf.main(["--model", tiny_ckpt, "--data", "x.jsonl"]) == 1
    assert (
        f"eval_hf.py: error: {tiny_ckpt} is a pipeline checkpoint, not a Hugging Face model: export it with "
        f"`python convert2ckpt.py --to-hf --input {tiny_ckpt}" in capsys.readouterr().err
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_gpu_check_stops_at_once_without_a_gpu():
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("gpu_check.sh: error: no CUDA GPU on this machine")
    assert not os.path.exists(os.path.join(REPO, ".venv-gpu"))  # nothing set up
