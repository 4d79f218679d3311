"""Checkpoints: `manager` saves and restores the train state with Orbax (async, exact resume onto
any mesh); `local` is the fast local tier (checkpoint.local: each process's shards on its own disk,
restored when the persistent tier is older); `integrity` records and checks both tiers' checksums;
`diagnose` explains a checkpoint that does not fit or read back; `listing` reads what is on disk
(`shardtrain ckpt`, `--verify`)."""
