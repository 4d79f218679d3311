"""Checkpoints: `manager` saves and restores the train state with Orbax (async, exact resume onto
any mesh); `diagnose` explains a checkpoint that does not fit or read back; `listing` reads what
is on disk (`shardtrain ckpt`)."""
