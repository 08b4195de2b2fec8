"""Every bad input is refused by `hpctrain.tasks.configure.parse`: one ValueError naming the key
and the fix.

Each row of BAD is a mistake a user makes (or a relative of one): the overrides, then words
the single message must contain — the key (with its value) and the fix. `{d}` is a folder
holding a tiny file, an empty file, a folder, a short file, an empty "checkpoint", a run
directory with two checkpoints and two prepared token directories (short; broken meta.json).
"""

from __future__ import annotations

import dataclasses
import gzip
import typing

import pytest

from hpctrain.config.schema import RUN_GROUPS
from hpctrain.config.validate.keys import RANGES
from tests.conftest import make_config
from tests.unit.tokenizer_files import hf_tokenizer_dir, tiktoken_file

PLAN = ["task=plan", "cluster.accelerator=H100-SXM"]
FILES = "data=files"
BAD = [
    # cluster
    (["cluster.procs_per_node=0"], ["cluster.procs_per_node=0 must be > 0",
                                    "cluster.procs_per_node=1"]),
    (["cluster.nodes=0"], ["cluster.nodes=0 must be > 0", "1 or more"]),
    (["cluster.nodes=2"], ["cluster.nodes=2", "set cluster.nodes=1", "cluster=slurm"]),
    (["cluster.timeout_s=-5"], ["cluster.timeout_s=-5 must be in (0, 604800]",
                                "cluster.timeout_s=300"]),
    (["cluster.timeout_s=99999999999"], ["cluster.timeout_s=99999999999 must be in (0, 604800]",
                                         "at most a week"]),
    (["cluster.threads_per_proc=0"], ["cluster.threads_per_proc=0", "1 or more"]),
    (["cluster.time_min=0"], ["cluster.time_min=0", "cluster.time_min=60"]),
    (["cluster.gpus_per_node=-1"], ["cluster.gpus_per_node=-1 must be ≥ 0", "set it to 0"]),
    (["cluster.cpus_per_task=0"], ["cluster.cpus_per_task=0", "1 or more"]),
    (["cluster.mem_gb=-4"], ["cluster.mem_gb=-4", "0 (all of a node's memory)"]),
    (["cluster.signal_delay_s=-1"], ["cluster.signal_delay_s=-1", "signal_delay_s=120"]),
    (["cluster.intra_node_gb_s=0"], ["cluster.intra_node_gb_s=0.0 must be > 0", "300.0"]),
    (["cluster.inter_node_gb_s=-1"], ["cluster.inter_node_gb_s=-1.0", "200.0"]),
    (["cluster.achievable_fraction=0"], ["cluster.achievable_fraction=0.0 must be in (0, 1]",
                                         "0.5"]),
    (["cluster.achievable_fraction=1.5"], ["cluster.achievable_fraction=1.5", "0.5"]),
    (["cluster.calibration=/nonexistent/bench.json"],
     ["cluster.calibration='/nonexistent/bench.json'", "task=bench"]),
    (["cluster.accelerator=H900"], ["cluster.accelerator='H900'", "H100-SXM"]),
    (["cluster.device=tpu"], ["cluster.device='tpu'", "'cuda'"]),
    (["cluster.backend=mpi"], ["cluster.backend='mpi'", "'gloo'"]),
    (["cluster.launcher=k8s"], ["cluster.launcher='k8s'", "'slurm'"]),
    (["cluster.timeout_s=abc"], ["cluster.timeout_s='abc' should be int", "cluster.timeout_s=300"]),
    (["cluster=slurm", "cluster.procs_per_node=1", "cluster.time_min=1",
      "cluster.signal_delay_s=120"],
     ["cluster.signal_delay_s=120 is not below cluster.time_min=1", "time_min to 3"]),
    # parallel
    (["parallel=cp2", "cluster.procs_per_node=2", "train.seq_len=63"],
     ["train.seq_len=63 is not divisible by 2 × parallel.cp=2", "multiple of 4 (e.g. 60 or 64)",
      "parallel.cp in [1]"]),
    (["parallel=auto", "cluster.procs_per_node=0"], ["cluster.procs_per_node=0 must be > 0"]),
    (["parallel=auto", "cluster.procs_per_node=2", "plan.headroom=1.5"],
     ["plan.headroom=1.5 must be in [0, 1)"]),
    (["parallel.dp=0"], ["parallel.dp=0 must be > 0", "1 or more"]),
    (["parallel.tp=0"], ["parallel.tp=0 must be > 0", "1 or more"]),
    (["parallel.pp=0"], ["parallel.pp=0 must be > 0", "1 or more"]),
    (["parallel.dp=-2"], ["parallel.dp=-2 must be > 0", "1 or more"]),
    (["parallel.zero=4"], ["parallel.zero=4 must be in [0, 3]", "0 (plain data parallel)"]),
    (["parallel.zero=-1"], ["parallel.zero=-1", "ZeRO stages"]),
    (["parallel.microbatches=0"], ["parallel.microbatches=0", "unset (null)"]),
    (["parallel.virtual_stages=0"], ["parallel.virtual_stages=0", "1 or more"]),
    (["parallel.bucket_mb=0"], ["parallel.bucket_mb=0.0 must be > 0", "bucket_mb=25"]),
    (["parallel.offload=gpu"], ["parallel.offload='gpu'", "'cpu'"]),
    (["parallel.grad_comm_dtype=int8"], ["parallel.grad_comm_dtype='int8'", "'bf16'"]),
    (["parallel.dp=2"], ["= 2 ranks", "set parallel.dp=1", "cluster.procs_per_node=2"]),
    (["parallel.pp=2", "cluster.procs_per_node=2", "parallel.schedule=interleaved_1f1b"],
     ["interleaved_1f1b needs virtual_stages >= 2", "parallel.virtual_stages=2"]),
    ([*PLAN, "parallel.pp=2", "parallel.schedule=interleaved_1f1b"],
     ["interleaved_1f1b needs virtual_stages >= 2", "parallel.virtual_stages=2"]),
    (["parallel.tp=3", "cluster.procs_per_node=3"],
     ["model.n_heads=4 is not divisible by parallel.tp=3", "divisors of the head count"]),
    # train
    (["train.steps=-1"], ["train.steps=-1 must be > 0", "1 or more"]),
    (["train.seed=-1"], ["train.seed=-1", "between 0 and"]),
    (["train.global_batch_size=0"], ["train.global_batch_size=0", "1 or more"]),
    (["train.micro_batch_size=0"], ["train.micro_batch_size=0", "1 or more"]),
    (["train.micro_batch_size=-4"], ["train.micro_batch_size=-4", "1 or more"]),
    (["train.seq_len=0"], ["train.seq_len=0 must be ≥ 2", "train.seq_len=128"]),
    (["train.seq_len=1"], ["train.seq_len=1 must be ≥ 2", "train.seq_len=128"]),
    (["train.grad_clip=-1"], ["train.grad_clip=-1.0 must be ≥ 0", "0 (no clipping)"]),
    (["train.log_every=0"], ["train.log_every=0", "1 or more"]),
    (["train.eval_every=-10"], ["train.eval_every=-10 must be ≥ 0", "0 (no evaluation)"]),
    (["train.eval_samples=0"], ["train.eval_samples=0 must be > 0", "train.eval_every=0"]),
    (["+train.eval_batches=4"], ["train.eval_batches", "replaced by train.eval_samples",
                                 "train.eval_samples=16"]),
    (["parallel.dp=2", "cluster.procs_per_node=2", "train.eval_samples=12"],
     ["train.eval_samples=12 is not divisible by parallel.dp=2 × train.micro_batch_size=4 = 8",
      "train.eval_samples=8 or train.eval_samples=16"]),
    (["train.checkpoint_every=-5"], ["train.checkpoint_every=-5", "0 (save at the end only)"]),
    (["train.profile_steps=0"], ["train.profile_steps=0", "1 or more"]),
    (["train.stop_after=-1"], ["train.stop_after=-1", "null to run all train.steps"]),
    (["train.stop_after=0"], ["train.stop_after=0", "null to run all train.steps"]),
    (["train.resume=nevr"], ["train.resume='nevr'", "did you mean train.resume=never"]),
    (["train.resume=atuo"], ["train.resume='atuo'", "did you mean train.resume=auto"]),
    (["train.resume=/nonexistent/ckpt"], ["train.resume='/nonexistent/ckpt': no such directory",
                                          "checkpoints/step_"]),
    (["train.resume={d}/tiny.txt"], ["a file, not a directory", "train.resume=never"]),
    (["train.resume={d}/ckempty"], ["no train_state.json", "train.resume=auto"]),
    (["train.resume={d}/run"], ["is a run directory, not a checkpoint",
                                "train.resume={d}/run/checkpoints/step_00000020 (its newest)"]),
    (["train.precision=fp64"], ["train.precision='fp64'", "'bf16'"]),
    (["train.activation_checkpointing=all"], ["train.activation_checkpointing='all'", "'full'"]),
    (["train.global_batch_size=6"], ["train.global_batch_size=6 is not divisible",
                                     "use a multiple such as 4"]),
    (["train.seq_len=512"], ["train.seq_len=512 exceeds model.max_seq_len=256",
                             "lower train.seq_len"]),
    (["train.steps=1.5"], ["train.steps=1.5 should be int", "train.steps=200"]),
    (["train.grad_clip=abc"], ["train.grad_clip='abc' should be float", "train.grad_clip=1.0"]),
    # optim
    (["optim.lr=-1"], ["optim.lr=-1.0 must be > 0", "optim.lr=3e-3"]),
    (["optim.lr=nan"], ["optim.lr=nan must be a finite number", "optim.lr=3e-3"]),
    (["optim.lr=inf"], ["optim.lr=inf must be a finite number", "optim.lr=3e-3"]),
    (["optim.min_lr=1.0"], ["optim.min_lr=1 exceeds optim.lr=0.003", "333× its peak",
                            "optim.min_lr=0.0003"]),
    (["optim.min_lr=-0.1"], ["optim.min_lr=-0.1 must be ≥ 0", "lr/10"]),
    (["optim.beta1=1.5"], ["optim.beta1=1.5 must be in [0, 1)", "optim.beta1=0.9"]),
    (["optim.beta1=-0.1"], ["optim.beta1=-0.1", "optim.beta1=0.9"]),
    (["optim.beta2=1.0"], ["optim.beta2=1.0 must be in [0, 1)", "optim.beta2=0.95"]),
    (["optim.eps=0"], ["optim.eps=0.0 must be > 0", "optim.eps=1e-8"]),
    (["optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1", "set it to 0"]),
    (["optim.warmup_steps=-5"], ["optim.warmup_steps=-5 must be ≥ 0", "0 (no warmup)"]),
    (["optim.lr_schedule=cosinus"], ["optim.lr_schedule='cosinus'",
                                     "did you mean optim.lr_schedule=cosine?"]),
    (["optim.lr_schedule=linear", "optim.min_lr=1"], ["the linear schedule decays",
                                                      "optim.min_lr=0.0003"]),
    (["optim.lr_schedule=inv_sqrt", "optim.warmup_steps=0"],
     ["optim.lr_schedule=inv_sqrt", "needs optim.warmup_steps ≥ 1", "optim.warmup_steps=20"]),
    (["optim.lr_schedule=wsd", "optim.decay_fraction=0.95"],
     ["optim.decay_fraction=0.95 of train.steps=200 is 190 decay steps",
      "optim.warmup_steps=20", "at most 0.9"]),
    (["optim.decay_fraction=0"], ["optim.decay_fraction=0.0 must be in (0, 1]", "e.g. 0.2"]),
    (["optim.decay_shape=exp"], ["optim.decay_shape='exp'", "'1-sqrt'"]),
    (["optim.name=sgd"], ["optim.name='sgd'", "optim.name=adamw"]),
    # data
    (["data.val_fraction=0"], ["data.val_fraction=0.0 must be in (0, 1)", "val_fraction=0.01"]),
    (["data.val_fraction=1"], ["data.val_fraction=1.0 must be in (0, 1)", "val_fraction=0.01"]),
    (["data.max_bytes=0"], ["data.max_bytes=0 must be > 0", "data.max_bytes=4000000"]),
    (["data.bpe_vocab_size=100"], ["data.bpe_vocab_size=100 must be ≥ 257",
                                   "data.bpe_vocab_size=512"]),
    (["data.tokenizer=bpe", "data.bpe_vocab_size=1024"],
     ["model.vocab_size=512 is smaller than the 1024 token ids", "set model.vocab_size=1024"]),
    (["data.tokenizer=word"], ["data.tokenizer='word'", "'byte'"]),
    (["data.source=web"], ["data.source='web'", "'files'"]),
    ([FILES], ["data.source=files needs data.paths", "data.paths=["]),
    ([FILES, "data.paths=[{d}/tiny.txt]"],
     ["train split holds 1 tokens", "train.global_batch_size=16 × train.seq_len=128 + 1 = 2049",
      "add data", "val split holds 1 tokens"]),
    ([FILES, "data.paths=[{d}/empty.txt]"],
     ["train split holds 0 tokens", "= 2049", "lower train.global_batch_size"]),
    ([FILES, "data.paths=[{d}/short.txt]"],
     ["val split holds 40 tokens", "= 513", "raise data.val_fraction", "train.eval_every=0"]),
    ([FILES, "data.paths=[{d}/short.txt]", "train.eval_every=0", "data.val_fraction=0.001"],
     ["val split holds 4 tokens", "one sample needs: train.seq_len=128 + 1 = 129"]),
    ([FILES, "data.paths=[{d}/emptydir]"], ["data.paths: {d}/emptydir holds no files",
                                            "'{d}/emptydir/*.txt'"]),
    ([FILES, "data.format=jsonl", "data.paths=[{d}/adir]"],
     ["{d}/adir holds no .jsonl/", "data.format=jsonl", "'{d}/adir/*.jsonl'"]),
    ([FILES, "data.format=hf", "data.paths=[{d}/adir]"],
     ["{d}/adir is not a dataset saved by datasets' save_to_disk", "another data.format"]),
    (["data.format=csv"], ["data.format='csv'", "'jsonl'"]),
    ([FILES, "data.mixture=[{paths:[{d}/short.txt],weight:0}]"],
     ["data.mixture[0].weight=0 must be > 0", "data.mixture[0].weight=1"]),
    ([FILES, "data.mixture=[{paths:[{d}/short.txt],weight:1},{paths:[{d}/none*.txt],weight:1}]"],
     ["data.mixture[1].paths: no file matches {d}/none*.txt"]),
    ([FILES, "data.paths=[{d}/short.txt]", "data.mixture=[{paths:[{d}/short.txt],weight:1}]"],
     ["and data.mixture both name the corpus", "give either"]),
    (["data.mixture=[{paths:[{d}/short.txt],weight:1}]"],
     ["data.mixture reads files, but data.source=stdlib", "set data=files"]),
    ([FILES, "data.mixture=[{path:[{d}/short.txt],weight:1}]"],
     ["unknown key data.mixture[0].path", "Did you mean data.mixture[0].paths?"]),
    ([FILES, "data.mixture=[{name:a,paths:[{d}/short.txt],weight:1}]",
      "data.stages=[{until_step:5,mixture:{a:1}},{until_step:3,mixture:{b:1}}]"],
     ["data.stages[1].until_step=3 must be > data.stages[0].until_step=5",
      "data.stages[1].mixture names ['b'], not corpora of data.mixture (['a'])"]),
    ([FILES, "data.mixture=[{name:a,paths:[{d}/short.txt],weight:1}]",
      "data.stages=[{until_step:5,mixture:{a:-1}}]"],
     ["data.stages[0].mixture={'a': -1} needs weights ≥ 0 with a positive sum",
      "data.stages[0].mixture={a: 1}"]),
    ([FILES, "data.mixture=[{name:a,paths:[{d}/short.txt],weight:1},"
      "{name:a,paths:[{d}/short.txt],weight:1},{name:'a b',paths:[{d}/short.txt],weight:1}]"],
     ["data.mixture names ['a'] more than one corpus", "data.mixture[2].name='a b' is not a "
      "metric name"]),
    ([FILES, "data.paths=[{d}/short.txt]", "data.stages=[{until_step:5,mixture:{a:1}}]"],
     ["data.stages weighs the corpora of data.mixture, but there is none"]),
    ([FILES, "data.mixture=[{name:a,paths:[{d}/short.txt],weight:1}]",
      "data.stages=[{until:5,mixture:{a:1}}]"], ["unknown key data.stages[0].until"]),
    ([FILES, "data.paths=[{d}/short.txt]", "data.val_paths=[{d}/nothere*.txt]"],
     ["data.val_paths: no file matches {d}/nothere*.txt", "check the path"]),
    (["data.val_paths=[{d}/tiny.txt]"], ["data.val_paths reads files, but data.source=stdlib",
                                         "set data=files"]),
    ([FILES, "data.paths=[{d}/short.txt]", "data.val_paths=[{d}/tiny.txt]"],
     ["val split holds 2 tokens (data.val_paths)", "add data to data.val_paths"]),
    (["data.on_bad_record=ignore"], ["data.on_bad_record='ignore'", "'skip'"]),
    (["data.workers=0"], ["data.workers=0 must be > 0", "data.workers=4"]),
    (["data.shard_bytes=0"], ["data.shard_bytes=0 must be > 0", "data.shard_bytes=64000000"]),
    (["data.tokenizer=hf"], ["data.tokenizer=hf needs data.tokenizer_path",
                             "data.tokenizer_path=<dir with tokenizer.json>"]),
    (["data.tokenizer=hf", "data.tokenizer_path={d}/nothing.json"],
     ["data.tokenizer_path={d}/nothing.json: no such file"]),
    (["data.tokenizer=tiktoken", "data.tokenizer_path={d}/cl100k_base.tiktoken"],
     ["names no end-of-document token", "set data.eod_token=", "<|endoftext|>"]),
    (["data.tokenizer=hf", "data.tokenizer_path={d}/hftok", "data.eod_token='<end>'"],
     ["data.eod_token='<end>' is not a token of data.tokenizer_path={d}/hftok", "</s>"]),
    (["data.tokenizer=hf", "data.tokenizer_path={d}/hftok"],
     ["model.vocab_size=512 is smaller than the 607 token ids of data.tokenizer=hf "
      "({d}/hftok)", "set model.vocab_size=1024"]),
    (["data.tokenizer=byte", "data.bos_token='<s>'"], ["data.bos_token='<s>'", "remove"]),
    # issue 45: inputs identified by content where names lie, a tokenizer file never ignored
    ([FILES, "data.format=hf", "data.paths=[{d}/dsmissing]"],
     ["{d}/dsmissing lacks data-00000-of-00001.arrow, which its state.json lists",
      "save the dataset again"]),
    ([FILES, "data.paths=[{d}/short.txt,{d}/adir]", "data.val_paths=[{d}/short.txt]"],
     ["data.val_paths holds {d}/short.txt, which data.paths trains on too",
      "remove it from one of them"]),
    ([FILES, "data.paths=[{d}/short.txt]", "data.tokenizer=byte", "data.tokenizer_path={d}/hftok"],
     ["data.tokenizer=byte reads no tokenizer file, but data.tokenizer_path={d}/hftok is "
      "given", "set data.tokenizer=hf"]),
    ([FILES, "data.paths=[{d}/docs.jsonl.gz]"],
     ["{d}/docs.jsonl.gz is a gzip file (its first bytes), which data.format=text would "
      "tokenise as one document of raw bytes", "set data.format=jsonl"]),
    ([FILES, "data.paths=[{d}/docs.zst]"], ["{d}/docs.zst is a zstd file",
                                            "set data.format=jsonl"]),
    ([FILES, "data.paths=[{d}/rows.parquet]"], ["{d}/rows.parquet is a parquet file",
                                                "set data.format=parquet"]),
    ([FILES, "data.format=jsonl", "data.paths=[{d}/rows.parquet]"],
     ["{d}/rows.parquet is a Parquet file (its first bytes), not JSON Lines",
      "set data.format=parquet"]),
    ([FILES, "data.format=parquet", "data.paths=[{d}/short.txt]"],
     ["{d}/short.txt is not a Parquet file (it does not begin with PAR1)",
      "set data.format=jsonl or text"]),
    ([FILES, "data.paths=[/nonexistent/*.txt]"], ["no file matches /nonexistent/*.txt",
                                                  "check the path"]),
    (["data.source=tokens", "data.paths=[{d}/adir]"], ["lacks meta.json, train.bin, val.bin",
                                                       "prepare"]),
    (["data.source=tokens", "data.paths=[{d}/badtok]"], ["has an unreadable meta.json",
                                                         "data.source=files"]),
    (["data.source=tokens", "data.paths=[{d}/tok]", "model.vocab_size=256"],
     ["model.vocab_size=256 is smaller than the 300 token ids of prepared data",
      "set model.vocab_size=512"]),
    (["data.source=tokens", "data.paths=[{d}/tok]"], ["train split holds 100 tokens", "= 2049",
                                                      "val split holds 10 tokens"]),
    (["data.cache_dir={d}/tiny.txt/cache"], ["data.cache_dir={d}/tiny.txt/cache",
                                             "is a file", "writable directory"]),
    # model
    (["model.vocab_size=100"], ["model.vocab_size=100 is smaller than the 257 token ids",
                                "set model.vocab_size=512"]),
    (["model.vocab_size=0"], ["model.vocab_size=0 must be > 0", "1 or more"]),
    (["model.dim=0"], ["model.dim=0 must be > 0", "1 or more"]),
    (["model.n_layers=0"], ["model.n_layers=0 must be > 0", "1 or more"]),
    (["model.n_heads=0"], ["model.n_heads=0 must be > 0", "1 or more"]),
    (["model.n_kv_heads=0"], ["model.n_kv_heads=0 must be > 0", "1 or more"]),
    (["model.ffn_dim=-8"], ["model.ffn_dim=-8 must be > 0", "1 or more"]),
    (["model.max_seq_len=0"], ["model.max_seq_len=0 must be ≥ 2", "max_seq_len=256"]),
    (["model.rope_theta=0"], ["model.rope_theta=0.0 must be > 0", "rope_theta=10000"]),
    (["model.norm_eps=-1"], ["model.norm_eps=-1.0 must be > 0", "norm_eps=1e-5"]),
    (["model.dim=36"], ["model.dim=36 / model.n_heads=4 = 9 is an odd head dimension",
                        "even quotient"]),
    (["model.n_heads=3"], ["model.dim=128 is not divisible by model.n_heads=3",
                           "set model.head_dim"]),
    (["model.head_dim=-2"], ["model.head_dim=-2 must be ≥ 0", "(model.dim / model.n_heads)"]),
    (["model.head_dim=7"], ["model.head_dim=7 is odd", "RoPE rotates pairs"]),
    (["model.moe.num_experts=-4"], ["model.moe.num_experts=-4 must be ≥ 0", "a dense model"]),
    (["model=debug_moe", "model.moe.every=5"], ["model.moe.every=5 exceeds model.n_layers=4",
                                                "choose every ≤ 4"]),
    (["model=debug_moe", "model.moe.every=0"], ["model.moe.every=0 must be > 0", "every block"]),
    (["model=debug_moe", "model.moe.top_k=-1"], ["model.moe.top_k=-1 must be > 0",
                                                 "model.moe.top_k=2"]),
    (["model=debug_moe", "model.moe.top_k=0"], ["model.moe.top_k=0 must be > 0"]),
    (["model=debug_moe", "model.moe.expert_ffn_dim=-8"], ["model.moe.expert_ffn_dim=-8 must be "
                                                          "≥ 0", "the model's ffn_dim"]),
    (["model=debug_moe", "model.moe.shared_experts=-1"], ["model.moe.shared_experts=-1"]),
    (["model=debug_moe", "model.moe.aux_loss_coef=nan"],
     ["model.moe.aux_loss_coef=nan must be a finite number ≥ 0", "no load-balancing loss"]),
    (["model=debug_moe", "model.moe.z_loss_coef=-1"], ["model.moe.z_loss_coef=-1.0 must be ≥ 0"]),
    (["model=debug_moe", "model.moe.capacity_factor=-1"], ["capacity_factor=-1.0", "dropless"]),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.factor=0.5"],
     ["model.rope_scaling.factor=0.5 must be ≥ 1"]),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.high_freq_factor=1"],
     ["high_freq_factor=1 must exceed model.rope_scaling.low_freq_factor=1", "1.0 and 4.0"]),
    (["model.dim=65536"], ["is predicted to need 779 GiB per rank",
                           "this host's memory shared by cluster.procs_per_node=1 ranks",
                           "make the model smaller", "plan.force=true"]),
    (["model.attention=magic"], ["model.attention='magic'", "'sdpa'"]),
    (["model.dim=abc"], ["model.dim='abc' should be int", "give a whole number"]),
    (["~model.dim"], ["model.dim is missing", "set model.dim=<int>"]),
    # logger
    (["logger.wandb=yes"], ["logger.wandb='yes'", "'offline'"]),
    (["logger.progress=fancy"], ["logger.progress='fancy'", "'plain'"]),
    # groups and tasks
    (["+trian.steps=10"], ["unknown top-level group trian", "did you mean train.steps?"]),
    (["+foo=1"], ["unknown top-level group foo", "remove +foo"]),
    (["task.name=trian"], ["task='trian'", "did you mean task=train?"]),
    ([*PLAN, "plan.top=0"], ["plan.top=0 must be > 0", "1 or more"]),
    ([*PLAN, "plan.dp_overlap=2"], ["plan.dp_overlap=2 must be in [0, 1]", "e.g. 0.0"]),
    ([*PLAN, "plan.n_devices=0"], ["plan.n_devices=0", "nodes × procs_per_node"]),
    ([*PLAN, "plan.zero_stages=[5]"], ["plan.zero_stages has [5]", "choose from 0, 1, 2, 3"]),
    (["task=simulate", "simulate.t_f=-1"], ["simulate.t_f=-1", ">= 0"]),
    (["task=bench", "bench.iters=0"], ["bench.iters=0 must be > 0", "1 or more"]),
    (["task=bench", "bench.warmup=-1"], ["bench.warmup=-1", "0 (no warmup)"]),
    (["task=bench", "bench.slow_ranks=[abc]"], ["bench.slow_ranks[0]='abc' should be int",
                                                "each a whole number"]),
    ([FILES, "data.paths=[1]"], ["data.paths[0]=1 should be str", "each a string"]),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "tiny.txt").write_text("x")
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("a" * 4052)  # 4053 tokens: 4013 train, 40 val at 1%
    (d / "adir").mkdir()
    (d / "emptydir").mkdir()
    hf_tokenizer_dir(d / "hftok", words=600)  # 607 token ids
    tiktoken_file(d / "cl100k_base.tiktoken")
    (d / "adir" / "a.txt").write_text("hi")
    (d / "dsmissing").mkdir()  # a saved dataset copied without its data file
    (d / "dsmissing" / "dataset_info.json").write_text("{}")
    (d / "dsmissing" / "state.json").write_text(
        '{"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}')
    (d / "docs.jsonl.gz").write_bytes(gzip.compress(b'{"text": "hello"}\n'))
    (d / "docs.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(12))  # a zstd frame's magic
    (d / "rows.parquet").write_bytes(b"PAR1" + bytes(12) + b"PAR1")
    (d / "ckempty").mkdir()
    for name, meta in (("tok", '{"dtype": "uint16", "train_tokens": 100, "val_tokens": 10, '
                               '"vocab_size": 300, "eod": 256}'), ("badtok", "{not json")):
        (d / name).mkdir()  # prepared token directories: a short one, a broken one
        for file, text in (("meta.json", meta), ("train.bin", ""), ("val.bin", "")):
            (d / name / file).write_text(text)
    for step in (10, 20):  # a run directory with two saved checkpoints
        ckpt = d / "run" / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "train_state.json").write_text("{}")
    return d


def _refusal(overrides: list[str], d, tmp_path) -> str:
    with pytest.raises(ValueError) as info:
        make_config([o.replace("{d}", str(d)) for o in overrides], run_dir=tmp_path)
    return str(info.value)


@pytest.mark.parametrize("overrides,expected", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_is_refused_with_key_and_fix(overrides, expected, inputs, tmp_path):
    message = _refusal(overrides, inputs, tmp_path)
    for text in expected:
        assert text.replace("{d}", str(inputs)) in message
    lines = message.splitlines()[1:]
    assert len(lines) == len(set(lines)), "a problem is listed twice"
    assert message.startswith(f"invalid configuration ({len(lines)} problem(s))")


def test_table_has_at_least_80_mistakes():
    assert len(BAD) >= 80


def test_zero_ranks_per_node_never_suggests_zero_data_parallel(inputs, tmp_path):
    message = _refusal(["cluster.procs_per_node=0"], inputs, tmp_path)
    assert "dp=0" not in message and "(1 problem(s))" in message


def test_every_mistake_of_a_config_is_listed_once(inputs, tmp_path):
    """Derived checks that would divide by zero (dp=0, n_heads=0) are skipped, not run."""
    message = _refusal(["parallel.dp=0", "model.n_heads=0", "train.steps=-1", "optim.beta1=1.5",
                        "+trian.steps=10", "train.resume=nevr", "train.steps=abc",
                        "optim.min_lr=1"], inputs, tmp_path)
    assert "(7 problem(s))" in message  # train.steps: the type error replaces the range one
    for key in ("parallel.dp=0", "model.n_heads=0", "optim.beta1=1.5", "group trian",
                "train.resume='nevr'", "train.steps='abc'", "optim.min_lr=1 exceeds"):
        assert key in message


PP2 = ["parallel.pp=2", "cluster.procs_per_node=2"]
ONE_PROBLEM = [  # each once: what used to be listed twice, or beside a misleading consequence
    ([*PP2, "train.global_batch_size=4"], "raise train.global_batch_size"),
    ([*PP2, "parallel.schedule=fancy"], "parallel.schedule='fancy'"),
    ([*PP2, "parallel.virtual_stages=3"], "1f1b runs one stage per rank"),
    (["cluster.nodes=2"], "set cluster.nodes=1"),
    ([FILES, "data.paths=[1]"], "data.paths[0]=1"),
]


@pytest.mark.parametrize("overrides,text", ONE_PROBLEM, ids=[" ".join(o) for o, _ in ONE_PROBLEM])
def test_one_problem_is_listed_once(overrides, text, inputs, tmp_path):
    message = _refusal(overrides, inputs, tmp_path)
    assert "(1 problem(s))" in message and text in message, message


def _numeric(hint) -> bool:
    args = typing.get_args(hint) or (hint,)
    return any(a in (int, float) for a in args)


def _numeric_keys(prefix: str, cls) -> list[str]:
    """Every numeric key of a config dataclass, nested groups (model.moe.*) included."""
    hints, keys = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += _numeric_keys(f"{prefix}.{f.name}", hints[f.name])
        elif _numeric(hints[f.name]):
            keys.append(f"{prefix}.{f.name}")
    return keys


@pytest.mark.parametrize("group", sorted(RUN_GROUPS))
def test_every_numeric_key_has_a_range(group):
    missing = [key for key in _numeric_keys(group, RUN_GROUPS[group]) if key not in RANGES]
    assert not missing, f"add these keys to hpctrain.config.validate.keys.RANGES: {missing}"


def test_predicted_split_is_what_prepare_writes(tmp_path):
    """The parse-time size (byte tokenizer, from file sizes; an empty file is skipped) equals
    the prepared one, whatever the shards."""
    from hpctrain.config.schema import DataConfig
    from hpctrain.data.checks import tokens_of
    from hpctrain.data.prepare import predicted_split, prepare

    for i, size in enumerate((0, 1, 700, 3000)):
        (tmp_path / f"{i}.txt").write_bytes(b"z" * size)
    for val_fraction, shard_bytes in ((0.1, 1), (0.01, 701), (0.5, 10_000)):
        data = DataConfig(source="files", paths=(str(tmp_path / "*.txt"),), max_bytes=10,
                          val_fraction=val_fraction, shard_bytes=shard_bytes,
                          cache_dir=str(tmp_path / "cache"))
        cfg = make_config(["train=debug"], run_dir=tmp_path)
        assert predicted_split(data) == tokens_of(cfg, prepare(data)), shard_bytes
    data = DataConfig(source="files", paths=(str(tmp_path / "[23].txt"),),
                      val_paths=(str(tmp_path / "[01].txt"),), cache_dir=str(tmp_path / "c"))
    assert predicted_split(data) == tokens_of(cfg, prepare(data)) == (3702, 2)


def test_data_shorter_than_a_batch_is_refused_after_prepare(tmp_path):
    """stdlib text is not predicted: dispatch.preflight prepares it, then refuses it."""
    from hpctrain import dispatch

    cfg = make_config(["data.max_bytes=100", f"data.cache_dir={tmp_path}"], run_dir=tmp_path)
    with pytest.raises(ValueError) as info:
        dispatch.preflight(cfg)
    message = str(info.value)
    assert "train split holds" in message and "= 2049" in message
    assert "data.max_bytes=100" in message and "prepared data:" in message


def test_a_run_inside_another_runs_checkpoints_is_refused(tmp_path):
    """Issue 45: hydra.run.dir inside run A's checkpoints/step_* was accepted; A then fell back
    10 steps (its retention and resume own everything there)."""
    other = tmp_path / "a"
    (other / ".hydra").mkdir(parents=True)
    inside = other / "checkpoints" / "step_00000010" / "b"
    inside.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"hydra.run.dir=.*is inside .*checkpoints, the "
                                         r"checkpoints of the run"):
        make_config([], run_dir=inside)
    make_config([], run_dir=tmp_path / "elsewhere")  # a neighbour is fine
