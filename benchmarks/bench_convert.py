"""Conversion speed and memory: convert2ckpt.py both ways against a raw copy of the same bytes.

    python benchmarks/bench_convert.py [--layers 5,24] [--hidden 1024] [--vocab 32000] [--shard 500MB] [--repeats 3]
    python benchmarks/bench_convert.py --read-paths CKPT/global_step0 [--repeats 3]   # the export's read path alone

For each layer count: a random fp32 Llama (hidden 1024, MHA, vocab 32000: ~0.5 GB with 5 layers,
~1.5 GB with 24) saved with ``save_pretrained(max_shard_size=--shard)``, then, --repeats times each:

  copy HF        read + write of the HF shards (1 MiB-buffer loop in a fresh process, like cp
                 without copy offload)
  HF -> stages   python convert2ckpt.py --input HF --output CKPT
  copy stages    read + write of the layer files
  stages -> HF   python convert2ckpt.py --to-hf --input CKPT --output HF2 (the converter's default
                 --max-shard-size, 2GB: the 1.5 GB model is exported as one shard)

Every conversion runs in a fresh process, timed from inside (after its imports, which are reported
apart: a fixed ~3 s of torch/transformers/deepspeed) and as a whole; its peak RSS is VmHWM of that
process, next to VmHWM after the imports. Every output is a new file; every timed step starts after
os.sync() and after one untimed read of its input (see warm()): the page cache cannot be dropped
without root, so the copy and the converter alike read their sources from the page cache, and
neither fsyncs what it writes. Targets: conversion (median of --repeats) >= 0.5 x the best copy's
MB/s, the fastest raw copy of the model's bytes in the run (either file set: writes on this VM vary
10x from one moment to the next, the same 1.4 GB of layer files copied in 0.3 s or 4 s, so the best
copy is the conservative baseline); peak RSS < 2 x the largest tensor + 1 GiB at every size. The
"with sync" columns add the os.sync() that follows each step (writing its output back to the disk):
what a model too big for the page cache costs, where the disk's own speed decides. The files live in
--work (under work/, git-ignored) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Run with the working directory --converter: its convert2ckpt.py, loaded as a module so that main() is timed
# apart from the imports, and (`python -c` puts that directory first on the module path) the modules it imports.
CONVERT = """
import importlib.util, json, time
t0 = time.time()

def hwm():  # peak RSS of this process (VmHWM, MiB); ru_maxrss would include the parent's RSS at fork
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024

spec = importlib.util.spec_from_file_location("convert2ckpt", "convert2ckpt.py")
converter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(converter)
t1 = time.time()
base = hwm()
rc = converter.main({argv!r})
t2 = time.time()
print("BENCH " + json.dumps({{"import_s": t1 - t0, "convert_s": t2 - t1, "rc": rc, "base_rss_mib": base,
                             "peak_rss_mib": hwm(), "module": converter.__file__}}))
"""


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def weight_files(path: str) -> list[str]:
    out = []
    for d, _, files in os.walk(path):
        out += [os.path.join(d, f) for f in files if f.endswith((".safetensors", "-model_states.pt"))]
    return sorted(out)


def warm(paths: list[str]) -> None:
    """Read every file once (untimed), so that the timed step reads it from the page cache.

    This VM reclaims page cache it considers cold (DAMON 'pageout', kdamond): a file written a few
    seconds earlier may already be back on disk, and without this, which of the copy and the converter
    read from disk was a matter of timing (a raw copy of 1.4 GB ranged from 0.3 s to 4 s)."""
    buf = bytearray(2**20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def run_copy(files: list[str], dst_dir: str) -> tuple[float, int]:
    """raw_copy in a fresh process, as each conversion runs (a long-lived process's writes were at
    times 10x slower here); (seconds, bytes), timed inside that process."""
    os.sync()
    warm(files)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--copy-worker", dst_dir, *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"copy failed:\n{proc.stderr[-3000:]}")
    seconds, nbytes, write_s = json.loads(proc.stdout.strip().splitlines()[-1])
    copy_write_s.append(write_s)
    sync_s.append(timed_sync())
    return seconds, nbytes


def raw_copy(files: list[str], dst_dir: str, buf_mib: int = 1) -> tuple[float, int]:
    """Read + write every file through a user-space buffer; (seconds, bytes)."""
    os.makedirs(dst_dir)
    buf = bytearray(int(buf_mib * 2**20))
    view, total, start, write_s = memoryview(buf), 0, time.time(), 0.0
    for i, src in enumerate(files):
        with open(src, "rb", buffering=0) as fi, open(os.path.join(dst_dir, f"{i:05d}.bin"), "wb", buffering=0) as fo:
            while n := fi.readinto(buf):
                t = time.perf_counter()
                fo.write(view[:n])
                write_s += time.perf_counter() - t
                total += n
    copy_write_s.append(write_s)
    return time.time() - start, total


copy_write_s: list[float] = []  # seconds in write() of each raw_copy (the rest is reads + opens)


def run_converter(argv: list[str], converter: str) -> dict:
    """convert2ckpt.main(argv) in a fresh process: its own timings, its RSS after imports and its peak RSS."""
    os.sync()  # no dirty pages left over from the previous step to be written back during this one
    warm(weight_files(argv[argv.index("--input") + 1]))
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT.format(argv=argv)], cwd=converter, capture_output=True, text=True
    )
    wall = time.time() - start
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"convert2ckpt.py {' '.join(argv)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    res = json.loads(line[len("BENCH ") :])
    res["wall_s"] = wall
    res["sync_s"] = timed_sync()
    return res


def timed_sync() -> float:
    """Seconds os.sync() takes: writing back what the step left in the page cache (its durable cost)."""
    start = time.time()
    os.sync()
    return time.time() - start


sync_s: list[float] = []  # timed_sync() after each run_copy


MAKE_MODEL = """
import json
import torch
from transformers import LlamaForCausalLM
from models.tiny import tiny_config
config = tiny_config(hidden_size={hidden}, intermediate_size={intermediate}, num_hidden_layers={layers},
                     vocab_size={vocab}, num_attention_heads={heads}, num_key_value_heads={heads})
torch.manual_seed(0)
model = LlamaForCausalLM(config)  # Hugging Face's own init; weights differ per tensor
model.save_pretrained({path!r}, max_shard_size={shard!r})
sizes = [p.numel() * p.element_size() for p in model.parameters()]
print("BENCH " + json.dumps([sum(p.numel() for p in model.parameters()), max(sizes)]))
"""


def make_model(path: str, layers: int, hidden: int, vocab: int, shard: str) -> tuple[int, int]:
    """A random fp32 Llama saved with save_pretrained (in a child process, so this one stays small);
    (parameters, bytes of the largest tensor)."""
    code = MAKE_MODEL.format(
        hidden=hidden,
        intermediate=int(hidden * 2.75),
        layers=layers,
        vocab=vocab,
        heads=hidden // 64,
        path=path,
        shard=shard,
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"making the model failed:\n{proc.stderr[-3000:]}")
    params, largest = json.loads(line[len("BENCH ") :])
    return params, largest


def read_paths(tag_dir: str, out: str, rounds: int) -> None:
    """The export's three ways to move layer-file bytes into an output file, interleaved in this process
    (same bytes, same page cache, minutes apart at most): a raw 1 MiB read/write loop; each tensor
    through ``models.files.hf_convert.write_tensor`` (``pread`` from its file, what the export does); each tensor
    written from its memory mapping in 256 KiB pieces (the export before)."""
    import torch

    from models.files.hf_convert import ChunkedWriter, write_tensor
    from models.files.pipeline_dir import load_layer_file

    files = sorted(os.path.join(tag_dir, f) for f in os.listdir(tag_dir) if f.startswith("layer_"))

    def tensors(f, write_one):
        for path in files:
            for t in load_layer_file(path).values():
                write_one(f, t)

    def through_mapping(f, t):
        f.write(t.reshape(-1).view(torch.uint8).numpy())  # ChunkedWriter: 256 KiB writes out of the mapping

    ways = {
        "raw copy (1 MiB read/write)": lambda f: raw_copy_into(files, f),
        "export: pread (write_tensor)": lambda f: tensors(f, write_tensor),
        "export: through the mapping": lambda f: tensors(f, through_mapping),
    }
    nbytes = sum(os.path.getsize(p) for p in files)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            warm(files)
            os.sync()
            start = time.perf_counter()
            with open(out, "wb", buffering=0) as raw:
                way(ChunkedWriter(raw))
            seconds[name].append(time.perf_counter() - start)
            os.remove(out)
    print(f"{len(files)} layer files, {nbytes / 2**20:.0f} MiB, {rounds} rounds interleaved, page cache, no fsync")
    print("| way | seconds per round | median (s) | MB/s |")
    print("|---|---|---|---|")
    for name, s in seconds.items():
        print(
            f"| {name} | {', '.join(f'{x:.2f}' for x in s)} | {statistics.median(s):.2f} | "
            f"{nbytes / statistics.median(s) / 1e6:.0f} |"
        )


def raw_copy_into(files: list[str], out) -> None:
    """Every byte of ``files`` to ``out`` through one 1 MiB buffer."""
    buf = bytearray(2**20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                out.write(memoryview(buf)[:n])


def main() -> None:
    if sys.argv[1:2] == ["--copy-worker"]:  # inside run_copy's process
        seconds, nbytes = raw_copy(sys.argv[3:], sys.argv[2])
        print(json.dumps([seconds, nbytes, copy_write_s[-1]]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="5,24", help="comma-separated decoder-layer counts (one model each)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard", default="500MB", help="max_shard_size of the input (save_pretrained)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=os.path.join(ROOT, "work", "bench_convert"))
    p.add_argument("--keep", action="store_true", help="keep the files")
    p.add_argument("--export-shard", default="", help="--max-shard-size of the export (default: the converter's, 2GB)")
    p.add_argument("--converter", default=ROOT, help="directory whose convert2ckpt.py to run (e.g. an older copy)")
    p.add_argument(
        "--read-paths",
        default="",
        metavar="TAG_DIR",
        help="instead: compare the export's ways of reading layer files (TAG_DIR: a checkpoint's global_stepN)",
    )
    args = p.parse_args()
    args.work = os.path.abspath(args.work)  # the conversions run in --converter's directory
    if args.read_paths:
        os.makedirs(args.work, exist_ok=True)
        read_paths(args.read_paths, os.path.join(args.work, "read_paths.out"), args.repeats)
        return

    free = shutil.disk_usage(os.path.dirname(args.work) if not os.path.exists(args.work) else args.work).free
    print(f"free disk: {free / 2**30:.1f} GiB", flush=True)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    rows = []
    try:
        for layers in (int(x) for x in args.layers.split(",")):
            hf = os.path.join(args.work, f"hf_{layers}")
            params, largest = make_model(hf, layers, args.hidden, args.vocab, args.shard)
            size = dir_bytes(hf)
            need = 6 * size
            if shutil.disk_usage(args.work).free < need:
                sys.exit(f"not enough free disk for {layers} layers: need ~{need / 2**30:.1f} GiB")
            times: dict[str, list] = {k: [] for k in ("copy_hf", "to_stages", "copy_stages", "to_hf")}
            for r in range(args.repeats):
                tag = f"{layers}_{r}"
                # Each output is deleted as soon as it is not needed (page cache this VM has to hold: less of it,
                # fewer writes that wait for reclaim).
                copy_s, copied = run_copy(weight_files(hf), os.path.join(args.work, f"copy_hf_{tag}"))
                times["copy_hf"].append((copy_s, copied, sync_s[-1]))
                shutil.rmtree(os.path.join(args.work, f"copy_hf_{tag}"))
                ckpt = os.path.join(args.work, f"ckpt_{tag}")
                times["to_stages"].append(run_converter(["--input", hf, "--output", ckpt], args.converter))
                copy_s, copied = run_copy(weight_files(ckpt), os.path.join(args.work, f"copy_ckpt_{tag}"))
                times["copy_stages"].append((copy_s, copied, sync_s[-1]))
                shutil.rmtree(os.path.join(args.work, f"copy_ckpt_{tag}"))
                back = os.path.join(args.work, f"back_{tag}")
                export_shard = ["--max-shard-size", args.export_shard] if args.export_shard else []
                times["to_hf"].append(
                    run_converter(["--to-hf", "--input", ckpt, "--output", back, *export_shard], args.converter)
                )
                for d in (f"back_{tag}", f"ckpt_{tag}"):
                    shutil.rmtree(os.path.join(args.work, d))
                print(
                    f"{layers} layers, repeat {r + 1}: copy HF {times['copy_hf'][-1][0]:.2f} s (writes "
                    f"{copy_write_s[-2]:.2f} s), "
                    f"HF->stages {times['to_stages'][-1]['convert_s']:.2f} s (process "
                    f"{times['to_stages'][-1]['wall_s']:.1f} s, "
                    f"peak RSS {times['to_stages'][-1]['peak_rss_mib']:.0f} MiB), copy stages "
                    f"{times['copy_stages'][-1][0]:.2f} s "
                    f"(writes {copy_write_s[-1]:.2f} s), "
                    f"stages->HF {times['to_hf'][-1]['convert_s']:.2f} s (process {times['to_hf'][-1]['wall_s']:.1f} "
                    "s, "
                    f"peak RSS {times['to_hf'][-1]['peak_rss_mib']:.0f} MiB)",
                    flush=True,
                )
            shutil.rmtree(hf)
            rows.append((layers, params, size, largest, times))
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)

    print()
    print(
        "| layers | params (M) | weights (MiB) | largest tensor (MiB) | direction | its copy, median (s) | best copy "
        "(MB/s) "
        "| convert, median (s) | convert (MB/s) | convert / best copy | with sync: copy / convert (s) | with sync: "
        "ratio "
        "| process wall (s) | import (s) | RSS after imports (MiB) | peak RSS (MiB) | RSS limit (MiB) | speed target "
        "| memory target |"
    )
    print("|---" * 19 + "|")
    for layers, params, size, largest, times in rows:
        limit = (2 * largest + 2**30) / 2**20
        # The baseline: the fastest raw copy of this model's bytes in this run, either file set (see the docstring).
        best_copy = max(n / t for key in ("copy_hf", "copy_stages") for t, n, _ in times[key])
        for name, copy_key, conv_key in (
            ("HF -> stages", "copy_hf", "to_stages"),
            ("stages -> HF", "copy_stages", "to_hf"),
        ):
            copy_median = statistics.median(t for t, _, _ in times[copy_key])
            nbytes = times[copy_key][0][1]
            conv = times[conv_key]
            conv_s = statistics.median(c["convert_s"] for c in conv)
            rss = max(c["peak_rss_mib"] for c in conv)
            ratio = nbytes / conv_s / best_copy
            copy_durable = statistics.median(t + w for t, _, w in times[copy_key])
            conv_durable = statistics.median(c["convert_s"] + c["sync_s"] for c in conv)
            print(
                f"| {layers} | {params / 1e6:.0f} | {size / 2**20:.0f} | {largest / 2**20:.0f} | {name} | "
                f"{copy_median:.2f} | "
                f"{best_copy / 1e6:.0f} | {conv_s:.2f} | {nbytes / conv_s / 1e6:.0f} | {ratio:.2f} | "
                f"{copy_durable:.2f} / {conv_durable:.2f} | {copy_durable / conv_durable:.2f} | "
                f"{statistics.median(c['wall_s'] for c in conv):.1f} | "
                f"{statistics.median(c['import_s'] for c in conv):.1f} | "
                f"{statistics.median(c['base_rss_mib'] for c in conv):.0f} | {rss:.0f} | {limit:.0f} | "
                f"{'met' if ratio >= 0.5 else 'MISSED'} | {'met' if rss < limit else 'MISSED'} |"
            )


if __name__ == "__main__":
    main()
