"""Checkpoints: each rank saves and loads its own shards in torch.distributed.checkpoint's
format (`save_load`: the collective choice of what to load; `checkpointer`, `writer`: saves, in
the background or not; `shards`, `planners`: the chunks a rank owns), verified before anything is
read (`manifest`, `catalog`, `safe_load`), resumed under changed settings only when allowed
(`resume_changes`); Hugging Face directories in (`hf_import`: per rank) and out (`hf_export`),
and one whole model on one device (`one_device`)."""
