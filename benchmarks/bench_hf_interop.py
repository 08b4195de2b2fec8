"""Hugging Face interop (issue 25): import and export time and peak memory per rank of
hpctrain against transformers' own `from_pretrained` / `save_pretrained`, one model, one run.

Weights: a random Llama of `llama3_1b`'s shape by default (vocabulary 128,256, dim 2,048,
16 layers, 32 heads, 8 kv heads, SwiGLU 8,192, tied embeddings, Llama 3.2's RoPE scaling),
built by transformers on the meta device, filled with torch.randn in bf16 (as the published
checkpoint) and saved with `save_pretrained(max_shard_size="2GB")`. Every phase runs in its
own fresh spawned process(es), one after another, 1 thread each, so each peak is its own:

  transformers  `AutoModelForCausalLM.from_pretrained(dir, dtype=float32)`, then
                `save_pretrained` of that model (fp32, 2 GB files); logits of a short input
  hpctrain      per layout (dp=1; dp=`--world` ZeRO-3, gloo): the rank's ParallelState built
                as the Trainer builds it (`build_parallel_state`, no step; under ZeRO-3 the
                ranks build one after another so that one full fp32 init is alive at a time),
                then `load_hf_weights` timed alone (bytes read: its return value); then a
                synchronous checkpoint of those weights (not timed), and in one more process
                `export_hf` (task=export's body; export.dtype=fp32, the same file limit) from
                that checkpoint. Check, not timed: the exported directory loads back with
                from_pretrained and its logits, and those of the checkpoint on one device,
                equal the original's.

Memory: resident bytes (VmHWM, reset through /proc/self/clear_refs, freed heap returned with
malloc_trim first; `benchmarks.common.measure_phase`), the phase's peak over what was resident
when it began, and its absolute peak. Both sides map the safetensors files, so the file pages
they touch count in both. The whole-process peak (ru_maxrss) is printed too: for hpctrain it
includes the ParallelState (16 bytes per parameter owned: fp32 weights, gradients and two
AdamW moments), which an import fills but does not allocate. Two ratios, hpctrain over
transformers: of the peaks over the start (what the phase adds: transformers' from_pretrained
allocates its model, hpctrain's import fills a state already there; its save_pretrained writes
a model it holds, task=export reads the checkpoint first) and of the absolute peaks. Before each
hpctrain layout, a layout whose state cannot fit in MemAvailable is refused (`preflight`).

    python benchmarks/bench_hf_interop.py --write          # llama3_1b shape, dp=1 and dp=4
    python benchmarks/bench_hf_interop.py --dim 64 --layers 2 --vocab 512 --ffn 128 \\
        --heads 4 --kv-heads 2 --world 2                   # toy size (the smoke test)
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import measure_phase, spawn  # noqa: E402
from benchmarks.host import gib, host_line  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "hf_interop.md"
SHARD = 2 * 10**9  # save_pretrained(max_shard_size="2GB"); export.max_shard_mb the same
ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.2


def _one_thread() -> None:
    os.environ.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error",
                      HF_HUB_DISABLE_PROGRESS_BARS="1")
    torch.set_num_threads(1)


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _phase(fn) -> tuple[object, dict]:
    """fn() in a single process: its result and {s, peak_over_start, peak, ...}."""
    result, seconds, over, peak = measure_phase(fn, collective=False)
    return result, {"s": seconds, "over": over, "peak": peak}


def _child_entry(fn, args, out: str) -> None:
    _one_thread()
    Path(out).write_text(json.dumps(fn(*args)))


def in_child(fn, *args) -> dict:
    """fn(*args) in a fresh spawned process (its own peak memory); its JSON result."""
    with tempfile.TemporaryDirectory(prefix="bench-hf-") as tmp:
        out = os.path.join(tmp, "result.json")
        proc = multiprocessing.get_context("spawn").Process(target=_child_entry,
                                                            args=(fn, args, out))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{fn.__name__} exited with {proc.exitcode}")
        return json.loads(Path(out).read_text())


# -- the weights ------------------------------------------------------------------------------
def make_weights(shape: dict, out: str) -> dict:
    """A random Llama of `shape` saved to `out` in bf16 (meta init, filled in place)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["dim"],
                      intermediate_size=shape["ffn"], num_hidden_layers=shape["layers"],
                      num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                      max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling=dict(ROPE),
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.to_empty(device="cpu")
    model.tie_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0,
                      0.1 if name.endswith("norm.weight") else 0.02, generator=gen)
    model.save_pretrained(out, max_shard_size="2GB")
    return {"params": sum(p.numel() for p in model.parameters()),
            "file_bytes": sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))}


# -- transformers -----------------------------------------------------------------------------
def transformers_side(hf_dir: str, out: str, ids: list[int], logits_path: str) -> dict:
    """from_pretrained (its modules imported before: hpctrain's are too), then save_pretrained."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    rss0 = measure_phase(lambda: None, collective=False)[3]
    model, load = _phase(lambda: AutoModelForCausalLM.from_pretrained(hf_dir,
                                                                      dtype=torch.float32))
    with torch.no_grad():
        torch.save(model(torch.tensor([ids])).logits, logits_path)
    _, save = _phase(lambda: model.save_pretrained(out, max_shard_size="2GB"))
    return {"import": load, "export": save, "after_imports": rss0, "max_rss": _max_rss()}


# -- hpctrain ---------------------------------------------------------------------------------
def _config(hf_dir: str, layout: list[str], run_dir: str, world: int):
    from hydra import compose, initialize_config_dir

    from hpctrain.config.hydra_schema import register
    from hpctrain.launch import resolvers
    from hpctrain.tasks.configure import parse

    register()
    resolvers.register()
    base = ["model=hf", f"model.init_from={hf_dir}", "train=debug", "logger.wandb=disabled",
            "logger.progress=plain", "train.eval_every=0", "train.seq_len=64",
            "train.micro_batch_size=1", f"train.global_batch_size={world}",
            f"cluster.procs_per_node={world}", "cluster.timeout_s=1800",
            # no step runs, only the import: the training fit check (ZeRO-3 keeps each block's
            # gathered weights until backward, 4.6 GiB at dp=4) does not apply
            "plan.force=true"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return parse(compose(config_name="config", overrides=[*base, *layout]), run_dir=run_dir)


def _in_turn(rank: int, world: int, turns: Path, fn):
    """fn() on each rank in rank order (no collective: a file marks each rank's turn done),
    so that only one rank at a time holds the full fp32 init of the model."""
    while rank > 0 and not (turns / f"{rank - 1}").exists():
        time.sleep(0.05)
    result = fn()
    (turns / f"{rank}").touch()
    return result


def hpctrain_import(rank: int, world: int, args) -> dict:
    """Rank side: the ParallelState, then load_hf_weights timed alone, then a checkpoint."""
    import torch.distributed as dist

    from hpctrain.checkpoint import save_load as ckpt
    from hpctrain.checkpoint.hf_import import load_hf_weights
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.setup import build_parallel_state

    hf_dir, layout, run_dir = args
    cfg = _config(hf_dir, layout, run_dir, world)
    mesh = build_mesh(cfg.parallel.dims, rank=rank, device=torch.device("cpu"),
                      timeout=datetime.timedelta(seconds=cfg.cluster.timeout_s))
    turns = Path(run_dir) / "turns"
    turns.mkdir(parents=True, exist_ok=True)
    parallel, _ = _in_turn(rank, world, turns, lambda: build_parallel_state(cfg, mesh))
    read, seconds, over, peak = measure_phase(lambda: load_hf_weights(hf_dir, parallel=parallel))
    mine = {"s": seconds, "over": over, "peak": peak, "read": read, "max_rss": _max_rss()}
    ckpt.save(ckpt.checkpoint_dir(Path(run_dir), 0), parallel=parallel,
              train_state={"step": 0, "dp": world, "zero": cfg.parallel.zero},
              rank_state={}, model_config=cfg.model, keep=0)
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    return {"ranks": ranks, "params": cfg.model.num_params()}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def hpctrain_export(run_dir: str, out: str, ids: list[int], logits_path: str) -> dict:
    """task=export's body from `run_dir`'s checkpoint; then the logits check (not timed)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from hpctrain.checkpoint.hf_export import export_hf
    from hpctrain.checkpoint.one_device import load_one_device
    from hpctrain.config.export import ExportConfig

    logging.disable_progress_bar()
    settings = ExportConfig(from_=run_dir, out=out, dtype="fp32", max_shard_mb=SHARD / 2**20)
    _, export = _phase(lambda: export_hf(settings))
    max_rss = _max_rss()
    want = torch.load(logits_path)
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = load_one_device(from_=run_dir).model(x)
        back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(x).logits
    return {"export": export, "max_rss": max_rss, "scale": want.abs().max().item(),
            "diff_ckpt": _max_diff(ours, want), "diff_exported": _max_diff(back, want)}


def _available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def preflight(params: int, world: int, name: str) -> None:
    """Refuse a layout whose ParallelState cannot fit: 16 bytes per parameter over all ranks
    (fp32 weights, gradients, two AdamW moments), ~0.3 GiB of modules per process, and one
    rank's build transient (~1 byte per parameter, measured at 31.6M), before any rank starts."""
    need = 17 * params + world * 0.3 * 2**30
    if need > _available():
        raise SystemExit(f"{name}: the ranks' state needs ~{gib(need)} GiB but "
                         f"{gib(_available())} GiB is available: free memory or shrink the "
                         "model (--layers/--vocab)")


def hpctrain_side(hf_dir: str, tmp: Path, name: str, layout: list[str], world: int,
                  ids: list[int], logits_path: str, *, params: int) -> dict:
    run_dir, out = tmp / f"run-{name}", tmp / f"export-{name}"
    preflight(params, world, name)
    result = spawn(hpctrain_import, (hf_dir, layout, str(run_dir)), world=world,
                   timeout_s=1800)
    result.update(in_child(hpctrain_export, str(run_dir), str(out), ids, logits_path))
    shutil.rmtree(run_dir)  # the checkpoint (12 bytes per parameter) and the export: disk
    shutil.rmtree(out)
    return result


# -- report -----------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b >= 2**20 else "n/a"  # under 1 MiB: noise, not a base


def _row(label: str, s: float, over: float, peak: float, ref: dict, extra: str) -> str:
    return (f"| {label} | {s:.2f} | {gib(over)} | {gib(peak)} | {s / ref['s']:.2f}× | "
            f"{_ratio(over, ref['over'])} | {_ratio(peak, ref['peak'])} | {extra} |")


def table(kind: str, hf: dict, ours: dict[str, dict]) -> list[str]:
    """One side-by-side table (kind: import or export): transformers first, then each layout
    (import: the slowest rank's time, the largest rank's peak)."""
    ref = hf[kind]
    lines = [f"### {kind.capitalize()}",
             "| side | time (s) | peak over start (GiB) | peak (GiB) | time ratio | "
             "ratio over start | ratio peak | notes |", "|---|---|---|---|---|---|---|---|",
             _row("transformers " + ("from_pretrained" if kind == "import" else
                                     "save_pretrained"), ref["s"], ref["over"], ref["peak"],
                  ref, "1 process")]
    for name, r in ours.items():
        if kind == "import":
            ranks = r["ranks"]
            reads = ", ".join(f"{x['read'] / 2**20:.0f}" for x in ranks)
            lines.append(_row(f"hpctrain load_hf_weights {name}", max(x["s"] for x in ranks),
                              max(x["over"] for x in ranks), max(x["peak"] for x in ranks),
                              ref, f"{len(ranks)} rank(s); MiB read per rank: {reads}"))
        else:
            e = r["export"]
            lines.append(_row(f"hpctrain task=export from {name}", e["s"], e["over"],
                              e["peak"], ref, "1 process, sha256 verification included; "
                              f"process peak {gib(r['max_rss'])} GiB"))
    return lines


def per_rank(ours: dict[str, dict]) -> list[str]:
    lines = ["### hpctrain import per rank",
             "| layout | rank | time (s) | MiB read | peak over start (GiB) | peak (GiB) | "
             "process peak incl. ParallelState (GiB) |", "|---|---|---|---|---|---|---|"]
    for name, r in ours.items():
        for rank, x in enumerate(r["ranks"]):
            lines.append(f"| {name} | {rank} | {x['s']:.2f} | {x['read'] / 2**20:.0f} | "
                         f"{gib(x['over'])} | {gib(x['peak'])} | {gib(x['max_rss'])} |")
    return lines


def checks(ours: dict[str, dict]) -> list[str]:
    lines = ["### Correctness (not timed): logits of a 16-token input, max |difference| from "
             "transformers' on the original directory"]
    for name, r in ours.items():
        lines.append(f"- {name}: the checkpoint on one device (hpctrain) {r['diff_ckpt']:.2e}; "
                     f"the exported directory through from_pretrained {r['diff_exported']:.2e} "
                     f"(largest |logit| {r['scale']:.2f})")
    return lines


# -- main -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--vocab", 128256), ("--dim", 2048), ("--layers", 16),
                          ("--heads", 32), ("--kv-heads", 8), ("--ffn", 8192)):
        p.add_argument(flag, type=int, default=default, help=f"default {default} (llama3_1b)")
    p.add_argument("--world", type=int, default=4, help="ranks of the ZeRO-3 layout")
    p.add_argument("--tmp", default=None, help="where the weights, checkpoints and exports go")
    p.add_argument("--write", action="store_true", help=f"write {RESULTS.relative_to(ROOT)}")
    return p.parse_args()


def run(args: argparse.Namespace, tmp: Path) -> tuple[dict, dict, dict]:
    shape = {k: getattr(args, k) for k in ("vocab", "dim", "layers", "heads", "kv_heads", "ffn")}
    hf_dir = str(tmp / "hf")
    made = in_child(make_weights, shape, hf_dir)
    ids = torch.randint(0, args.vocab, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = str(tmp / "logits.pt")
    hf = in_child(transformers_side, hf_dir, str(tmp / "hf-saved"), ids, logits)
    shutil.rmtree(tmp / "hf-saved")
    layouts = {"dp=1": (["parallel.dp=1"], 1),
               f"dp={args.world} ZeRO-3": ([f"parallel.dp={args.world}", "parallel.zero=3"],
                                           args.world)}
    ours = {name: hpctrain_side(hf_dir, tmp, name.replace(" ", "-").replace("=", ""), layout,
                                world, ids, logits, params=made["params"])
            for name, (layout, world) in layouts.items()}
    return made, hf, ours


def main() -> None:
    args = parse_args()
    _one_thread()
    t0, load0 = time.time(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-hf-", dir=args.tmp) as tmp:
        made, hf, ours = run(args, Path(tmp))
    load1 = os.getloadavg()
    lines = ["# Hugging Face interop: hpctrain vs transformers", "",
             f"Command: `python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}` "
             f"({time.time() - t0:.0f} s, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "", host_line("transformers", "safetensors"),
             f"load average at start {load0[0]:.2f}, at end {load1[0]:.2f}",
             "", f"model: {made['params'] / 1e6:.1f}M parameters (vocab {args.vocab}, dim "
             f"{args.dim}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, ffn "
             f"{args.ffn}, tied), bf16 files {made['file_bytes'] / 2**30:.2f} GiB, read as "
             "fp32; exports fp32; every process 1 thread; ratios hpctrain / transformers",
             f"transformers' process: {gib(hf['after_imports'])} GiB resident after imports, "
             f"whole-process peak {gib(hf['max_rss'])} GiB", "",
             *table("import", hf, ours), "", *per_rank(ours), "", *table("export", hf, ours),
             "", *checks(ours)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        RESULTS.write_text(text)
        print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
